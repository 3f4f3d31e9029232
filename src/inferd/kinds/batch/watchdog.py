"""The watchdog: kills workers whose batch hangs or that went silent (the broken connection then recovers
their batches like any crash), hedges batches on slow workers (kinds/batch/hedging.py decides), and measures
the event loop's lag: how late its own timer fires tells whether the front end itself is saturated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from inferd.kinds.batch.hedging import HedgeDecision, HedgeInput, HedgePolicy
from inferd.kinds.batch.state import ModelState
from inferd.kinds.batch.worker_choice import Routing
from inferd.wire.connection import WorkerConnection, WorkerState

log = logging.getLogger("inferd.dispatcher")

WATCHDOG_INTERVAL_S = 0.1
LAG_ALPHA = 0.3
"""EWMA weight of the latest loop lag sample."""

KillWorker = Callable[[WorkerConnection], None]


class Watchdog:
    def __init__(
        self,
        state: ModelState,
        routing: Routing,
        hedging: HedgePolicy,
        kill_worker: KillWorker,
        heartbeat_timeout_s: float,
    ) -> None:
        self.state = state
        self.routing = routing
        self.hedging = hedging
        self.kill_worker = kill_worker
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.loop_lag_s = 0.0
        """EWMA of how late the watchdog's timer fired: the front end's own saturation."""

    async def run(self) -> None:
        """Every WATCHDOG_INTERVAL_S: measure the loop's lag, then check the workers. Until cancelled."""
        while True:
            started = time.perf_counter()
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            late = max(0.0, time.perf_counter() - started - WATCHDOG_INTERVAL_S)
            self.loop_lag_s += LAG_ALPHA * (late - self.loop_lag_s)
            self.check_workers()

    def check_workers(self) -> None:
        now = self.state.clock.now()
        limit = self.batch_timeout_s()
        for w in list(self.state.workers):
            if w.failure:
                continue
            if w.inflight:
                self._hedge_if_slow(w)
            if w.inflight and now - w.running_since > limit:
                w.failure = (
                    f"hung: a batch ran {now - w.running_since:.1f}s, over the {limit:.1f}s batch timeout"
                )
            elif now - w.last_heartbeat > self.heartbeat_timeout_s:
                w.failure = f"went silent: no heartbeat for {now - w.last_heartbeat:.1f}s"
            else:
                continue
            log.warning(
                "killing worker %s (pid %d) of model %s: %s", w.worker_id, w.pid, self.state.name, w.failure
            )
            self.kill_worker(w)

    def batch_timeout_s(self) -> float:
        """The configured batch timeout, else 10x the longest of the measured batch latency, a full batch's
        latency from the cost line and the slowest batch-size bucket measured (at least 1 s; 30 s before
        any batch was measured). The large batches count because mixed traffic (one-item queries between 32-item document batches) drives the
        average far below what a large batch legitimately takes."""
        if self.state.config.batch_timeout_s is not None:
            return self.state.config.batch_timeout_s
        estimator = self.state.estimator
        if estimator.batch_latency_s is None:
            return 30.0
        largest = max((latency for _, latency in estimator.curve()), default=0.0)  # by batch-size bucket
        expected = max(estimator.batch_latency_s, estimator.full_batch_latency_s() or 0.0, largest)
        return max(1.0, 10.0 * expected)

    def _hedge_if_slow(self, worker: WorkerConnection) -> None:
        config = self.state.config
        decision = self.hedging.decide(
            HedgeInput(
                worker.worker_id,
                tuple(worker.inflight.values()),
                worker.running_since,
                any(w is not worker and w.state is WorkerState.READY for w in self.state.workers),
                self.state.estimator.cost_line(),
                config.idempotent,
                config.max_attempts,
            )
        )
        if decision is not None:
            self._hedge(decision)

    def _hedge(self, decision: HedgeDecision) -> None:
        self.routing.overdue(decision.worker_id, decision.age_s)
        for batch in decision.batches:
            batch.hedged = True
        if not decision.items:
            return
        for item in decision.items:
            item.batch_id = 0
            item.hedged = True
        self.state.queue.push_front(decision.items)
        self.state.metrics.retried_items(decision.retried)
        log.warning(
            "model %s: worker %s has run a batch for %.2fs (expected %.2fs): %d item(s) hedged to others",
            self.state.name,
            decision.worker_id,
            decision.age_s,
            decision.expected_s,
            len(decision.items),
        )
        self.state.wake.set()
