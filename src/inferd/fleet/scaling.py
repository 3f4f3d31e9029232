"""The autoscaling driver: observe a model every interval, ask its Autoscaler (a pure policy), and act
through the fleet control (which starts workers, or drains them before they go)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from inferd.batching.admission import DrainEstimator
from inferd.fleet.autoscaler import Autoscaler, CurvePoint, Decision, Observation

if TYPE_CHECKING:
    from inferd.server import InferenceServer

log = logging.getLogger("inferd.autoscaler")

HISTORY = 20
"""Fleet changes kept for the admin API."""


class ScalingLoop:
    def __init__(
        self, server: InferenceServer, model: str, autoscaler: Autoscaler, interval_s: float = 1.0
    ) -> None:
        self.server = server
        self.model = model
        self.autoscaler = autoscaler
        self.interval_s = interval_s
        self.last: Decision | None = None
        self.changes: deque[tuple[float, Decision]] = deque(maxlen=HISTORY)
        """The latest decisions that changed the fleet, with their wall-clock time (for the admin API)."""
        self._enqueued = 0
        self._at = server.clock.now()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            decision = self.autoscaler.decide(self.observe())
            self.last = decision
            if decision.target_workers != decision.current_workers:
                self.changes.append((time.time(), decision))
                log.info(
                    "model %s: %s -> %d workers (%s)",
                    self.model,
                    decision.current_workers,
                    decision.target_workers,
                    decision.reason,
                )
                await self.server.fleet.scale_to(self.model, decision.target_workers)

    def report(self) -> dict[str, Any]:
        """The autoscaler's state for `inferd status`: its latest decision and its latest changes."""

        def row(d: Decision) -> dict[str, Any]:
            return {"from": d.current_workers, "to": d.target_workers, "reason": d.reason}

        return {
            "last": None if self.last is None else row(self.last),
            "changes": [{"at": round(at, 3), **row(d)} for at, d in self.changes],
        }

    @staticmethod
    def _curve(estimator: DrainEstimator, max_batch: int) -> tuple[CurvePoint, ...]:
        """The full-batch point of the measured cost line: what one worker can do when it is needed."""
        full = estimator.full_batch_latency_s()
        return () if full is None else (CurvePoint(max_batch, full),)

    def observe(self) -> Observation:
        rt = self.server.runtime(self.model)
        now = self.server.clock.now()
        elapsed = max(1e-3, now - self._at)
        rate = (rt.enqueued_total - self._enqueued) / elapsed
        self._enqueued, self._at = rt.enqueued_total, now
        slots = self.server.fleet.local_workers(self.model)
        return Observation(
            ready_workers=rt.ready_workers,
            starting_workers=max(0, slots - len(rt.workers)),
            queue_depth_items=len(rt.queue),
            arrival_rate_items_s=max(0.0, rate),
            max_batch_size=rt.config.max_batch_size,
            busy_ratio=min(1.0, max(0.0, rt.busy_ratio())),
            batch_latency_s=rt.estimator.batch_latency_s,
            items_per_batch=rt.estimator.items_per_batch,
            throughput_curve=self._curve(rt.estimator, rt.config.max_batch_size),
        )
