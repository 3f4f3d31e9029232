"""The autoscaling driver: observe a model's default version every interval through its runtime's
snapshot, ask its Autoscaler (a pure policy), and act through fleet control (which starts workers, or
drains them before they go). Batch models scale on batching-aware signals, LLM models on their engines'
pressure (KV use, TTFT, waiting sequences)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from inferd.clock import Clock
from inferd.config import ConfigError
from inferd.fleet.autoscaler import Autoscaler, AutoscalerConfig, Decision
from inferd.fleet.control import FleetControl
from inferd.fleet.demand import BatchDemand, CurvePoint, LLMDemand, LLMObservation, Observation
from inferd.runtime.contract import RuntimeStatistics
from inferd.runtime.registry import ModelRegistry

log = logging.getLogger("inferd.autoscaler")

HISTORY = 20
"""Fleet changes kept for the admin API."""


def check_autoscalable(kind: str) -> None:
    """Only kinds whose workers are ours scale: an [autoscale] table on another is a start-up error."""
    if kind not in ("batch", "llm"):
        raise ConfigError(f"[autoscale] is set on a {kind} model, which has no workers of ours: remove it")


def scaling_policy(kind: str, config: AutoscalerConfig, clock: Clock) -> Autoscaler:
    check_autoscalable(kind)
    demand = LLMDemand(config) if kind == "llm" else BatchDemand(config)
    return Autoscaler(config, clock, demand)


class ScalingLoop:
    def __init__(
        self,
        registry: ModelRegistry,
        fleet: FleetControl,
        clock: Clock,
        model: str,
        autoscaler: Autoscaler,
        interval_s: float = 1.0,
    ) -> None:
        self.registry = registry
        self.fleet = fleet
        self.clock = clock
        self.model = model
        self.autoscaler = autoscaler
        self.interval_s = interval_s
        self.last: Decision | None = None
        self.changes: deque[tuple[float, Decision]] = deque(maxlen=HISTORY)
        """The latest decisions that changed the fleet, with their wall-clock time (for the admin API)."""
        self._enqueued: tuple[int, int] | None = None
        """(version, items admitted) at the last look: the arrival rate of batch models."""
        self._at = clock.now()

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
                await self.fleet.scale_to(self.model, decision.target_workers)

    def report(self) -> dict[str, Any]:
        """The autoscaler's state for `inferd status`: its latest decision and its latest changes."""

        def row(d: Decision) -> dict[str, Any]:
            return {"from": d.current_workers, "to": d.target_workers, "reason": d.reason}

        return {
            "last": None if self.last is None else row(self.last),
            "changes": [{"at": round(at, 3), **row(d)} for at, d in self.changes],
        }

    def observe(self) -> Observation | LLMObservation:
        stats = self.registry.get(self.model).statistics()
        starting = max(0, self.fleet.local_workers(self.model) - len(stats.workers))
        if stats.kind == "llm":
            return _llm_observation(stats, starting)
        return self._batch_observation(stats, starting)

    def _batch_observation(self, stats: RuntimeStatistics, starting: int) -> Observation:
        d = stats.detail
        now = self.clock.now()
        elapsed = max(1e-3, now - self._at)
        previous = self._enqueued
        rate = 0.0
        if previous is not None and previous[0] == stats.version:  # a rolling update restarts the count
            rate = (d.enqueued_total - previous[1]) / elapsed
        self._enqueued, self._at = (stats.version, d.enqueued_total), now
        full = d.full_batch_latency_s
        return Observation(
            ready_workers=stats.ready_workers,
            starting_workers=starting,
            queue_depth_items=stats.queued,
            arrival_rate_items_s=max(0.0, rate),
            max_batch_size=d.max_batch_size,
            busy_ratio=min(1.0, max(0.0, d.busy_ratio)),
            batch_latency_s=d.batch_latency_s,
            items_per_batch=d.items_per_batch,
            throughput_curve=() if full is None else (CurvePoint(d.max_batch_size, full),),
        )


def _llm_observation(stats: RuntimeStatistics, starting: int) -> LLMObservation:
    d = stats.detail
    return LLMObservation(
        ready_workers=stats.ready_workers,
        starting_workers=starting,
        running_seqs=d.running,
        waiting_seqs=d.waiting,
        kv_usage=d.kv_blocks_used / d.kv_blocks_total if d.kv_blocks_total else 0.0,
        ttft_s=d.ttft_s,
    )
