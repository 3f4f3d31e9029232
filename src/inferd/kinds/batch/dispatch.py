"""Dispatch: when a batch is due, cut it from the queue and choose the worker that takes it.

schedule (policy.decide) -> cut (queue, under the mix cap) -> choose (p2c among free workers) -> send

A busy worker's staging slot is filled only near the end of its running batch (policy.stage_time), so
the staged batch is cut from what has arrived by then.

`Dispatcher` is the loop that cuts batches, retried (isolated) work first; the choice of worker is
`Routing`'s (kinds/batch/worker_choice.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys

from inferd.errors import DeadlineExceeded, Overloaded, retry_after_s
from inferd.kinds.batch.credit_demand import report_demand
from inferd.kinds.batch.delivery import fail
from inferd.kinds.batch.mix import MixInput, MixPolicy
from inferd.kinds.batch.policy import CutPolicy, stage_time
from inferd.kinds.batch.queue import ItemState, QueuedItem
from inferd.kinds.batch.state import ModelState
from inferd.kinds.batch.worker_choice import Routing
from inferd.observability import tracing
from inferd.routing.fairness import BULK, INTERACTIVE
from inferd.routing.locality import Backlog
from inferd.wire.connection import Batch, WorkerConnection, WorkerState

log = logging.getLogger("inferd.dispatcher")

_batch_ids = itertools.count(1)


class Dispatcher:
    """Cuts batches when the batching policy says they are due and sends each to a chosen worker."""

    def __init__(self, state: ModelState, routing: Routing, policy: CutPolicy, mix: MixPolicy) -> None:
        self.state = state
        self.routing = routing
        self.policy = policy
        self.mix = mix

    async def run(self) -> None:
        """The dispatch loop: send what is due, then sleep until the next event or the next cut time."""
        wake = self.state.wake
        while True:
            wake_at = self.dispatch_due()
            self.report_demand()
            wake.clear()
            if wake_at is None:
                await wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, wake_at - self.state.clock.now())):
                        await wake.wait()

    def dispatch_due(self) -> float | None:
        """Send every batch that is due now; return when to look again (None: at the next event)."""
        queue = self.state.queue
        self._shed_lost()
        while True:
            now = self.state.clock.now()
            backlog = self._backlog(now) if self.routing.zoned else None  # without zones: nothing to pay
            free = self.routing.free_workers(self.state.workers, now, backlog)
            idle, staging = free.idle, free.staging
            if self.state.isolation and (idle or staging):  # retried work first, to any free slot
                self._dispatch_isolated(self.routing.choose(idle or staging), now)
                continue
            times = {w.worker_id: self._stage_time(w) for w in staging}
            stage_at = min(times.values(), default=None)
            decision = self.policy.decide(now, len(queue), queue.oldest_at(), len(idle), len(staging), stage_at)
            if not decision.size:
                wake_queued = min((n for n in (decision.wake_queued, free.spill_at_queued) if n is not None), default=None)
                self.state.wake_queued = sys.maxsize if wake_queued is None else wake_queued
                return _earliest(decision.wake_at, free.spill_at)
            if not decision.idle and queue.live_in(INTERACTIVE) < decision.size:
                self.state.wake_queued = 1
                return None  # stage only all-interactive batches: interactive work never waits behind bulk
            due = [w for w in staging if times[w.worker_id] <= now]
            worker = self.routing.choose(idle if decision.idle else due)
            items, expired = self._cut_for(worker, decision.size, now, decision.since)
            self._expire_cut(expired, now)
            self._send(worker, items, now)

    def _backlog(self, now: float) -> Backlog | None:
        """The work the next batch serves, as the zone routing's load spill sees it (routing/locality.py):
        isolated (retried) work first, else the queue's oldest item; None: nothing waits. Its floor is its
        batching wait plus a batch's time (the measured EWMA), the longest a busy worker of its zone takes
        to free while the zone has the capacity."""
        state = self.state
        if state.isolation:
            group = state.isolation[0]
            if not group:
                return None
            oldest_at = min(i.enqueued_at for i in group)
            deadlines = [i.deadline for i in group if i.deadline is not None]
            deadline = min(deadlines) if deadlines else None
        else:
            head = state.queue.oldest()
            if head is None:
                return None
            oldest_at, deadline = head.enqueued_at, head.deadline
        latency_s = state.estimator.batch_latency_s
        return Backlog(
            waited_s=now - oldest_at,
            floor_s=state.config.max_wait_s + (latency_s or 0.0),
            queued=len(state.queue) + state.isolated_items(),
            bound=state.queue.max_size,
            max_batch=state.config.max_batch_size,
            batch_s=latency_s,
            remaining_s=None if deadline is None else deadline - now,
        )

    def report_demand(self) -> None:
        """Tell shared workers what is left queued, and give back slots this front end cannot use: with
        zones, those of the zones it would not send the work to now (routing/locality.py)."""
        queue, workers = self.state.queue, self.state.workers
        now = self.state.clock.now()
        oldest_at = queue.oldest_at()
        age_s = 0.0 if oldest_at is None else now - oldest_at
        queued = len(queue) + len(self.state.isolation)
        wanted = self.routing.wanted(workers, self._backlog(now)) if queued and self.routing.zoned else workers
        report_demand(wanted, queued, age_s)
        if len(wanted) < len(workers):
            asked = {id(w) for w in wanted}
            report_demand([w for w in workers if id(w) not in asked], 0, 0.0)

    def _cut_for(
        self, worker: WorkerConnection, size: int, now: float, since: float | None
    ) -> tuple[list[QueuedItem], list[QueuedItem]]:
        """Interactive items first, then bulk, up to the mix policy's cap (kinds/batch/mix.py)."""
        queue = self.state.queue
        bulk = queue.live_in(BULK)
        line = self.state.estimator.cost_line() if bulk else None
        if line is not None:  # the cap only ever limits batches that bulk could fill
            cap = self.mix.cap(
                MixInput(
                    now,
                    queue.live_in(INTERACTIVE),
                    bulk,
                    queue.last_arrival[INTERACTIVE],
                    line,
                    self._other_finishes(worker, line),
                )
            )
            size = min(size, cap)
        return queue.cut(size, now, since)

    def _stage_time(self, worker: WorkerConnection) -> float:
        """When the busy worker's staging slot may be filled: near the expected end of its running batch."""
        estimator = self.state.estimator
        line = estimator.cost_line()
        running = worker.running_items or sum(len(b.items) for b in worker.inflight.values())
        expected = estimator.batch_latency_s if line is None else line[0] + line[1] * running
        return stage_time(worker.running_since, expected)

    def _other_finishes(self, worker: WorkerConnection, line: tuple[float, float]) -> list[float]:
        """When the other busy workers are expected to finish what they hold (from the cost line)."""
        base, per_item = line
        return [
            w.running_since + sum(base + per_item * len(b.items) for b in w.inflight.values())
            for w in self.state.workers
            if w is not worker and w.inflight and w.state is WorkerState.READY
        ]

    def _dispatch_isolated(self, worker: WorkerConnection, now: float) -> None:
        group = self.state.isolation.popleft()
        live = [i for i in group if not i.reply.done()]
        expired = [i for i in live if i.deadline is not None and i.deadline <= now]
        self._expire_cut(expired, now)
        self._send(worker, [i for i in live if i not in expired], now)

    def _shed_lost(self) -> None:
        """SLO batching with shed_lost: the queued interactive items that can no longer meet the SLO get
        429 now. Not bulk (it uses spare capacity, on no deadline of the SLO's), not an item sent before
        (a crash's retry, or a hedge whose first batch may still answer it)."""
        now = self.state.clock.now()
        before = self.policy.lost_before(now)
        lost = [] if before is None else self.state.queue.enqueued_before(before, INTERACTIVE)
        lost = [i for i in lost if not i.attempts and not i.hedged]
        if not lost:
            return
        queue, name = self.state.queue, self.state.name
        ready = sum(w.state is WorkerState.READY for w in self.state.workers)
        drain = self.state.estimator.drain_time_s(len(queue) - len(lost), ready)
        for item in lost:
            waited_ms = 1000 * (now - item.first_enqueued_at)
            fail(queue, item, Overloaded(
                f"request to model '{name}' can no longer be answered within its SLO (it waited {waited_ms:.0f} "
                f"ms; [slo] shed_lost); retry in {retry_after_s(drain)} s", drain, reason="slo_lost",
            ))  # fmt: skip

    def _expire_cut(self, expired: list[QueuedItem], now: float) -> None:
        for item in expired:
            fail(
                self.state.queue,
                item,
                DeadlineExceeded(
                    f"request to model '{self.state.name}' expired after "
                    f"{1000 * (now - item.first_enqueued_at):.0f} ms before a batch slot was free"
                ),
            )

    def _send(self, worker: WorkerConnection, items: list[QueuedItem], now: float) -> None:
        if not items:
            return
        batch = Batch(next(_batch_ids), items, now, worker)
        for item in items:
            item.attempts += 1
            item.state = ItemState.RUNNING
            item.batch_id = batch.batch_id
        if tracing.ENABLED:
            batch.span = tracing.start_batch(batch.batch_id, items, worker.worker_id, self.state.name, now)
        worker.send_batch(batch)
        self.routing.sent(worker, len(items))
        self.state.metrics.observe_batch_cut(
            len(items), self.state.config.max_batch_size, [now - i.enqueued_at for i in items]
        )


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
