"""Dispatch: when a batch is due, cut it from the queue and choose the worker that takes it.

schedule (policy.decide) -> cut (queue, under the mix cap) -> choose (p2c among free workers) -> send

`Routing` is the choice of worker: the balancer (power of two choices) and the outlier ejector, fed with
each batch's outcome. `Dispatcher` is the loop that cuts batches, retried (isolated) work first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random

from inferd.batching.delivery import fail
from inferd.batching.mix import MixInput, MixPolicy
from inferd.batching.policy import BatchPolicy
from inferd.batching.queue import BULK, INTERACTIVE, ItemState, QueuedItem
from inferd.batching.state import ModelState
from inferd.errors import DeadlineExceeded
from inferd.routing import Candidate, EjectionRecord, Health, HealthChange, OutlierEjector, P2CBalancer
from inferd.worker import protocol as p
from inferd.worker.connection import Batch, WorkerConnection, WorkerState

log = logging.getLogger("inferd.dispatcher")

_batch_ids = itertools.count(1)


class Routing:
    """Which of a model's workers may take a batch, and which one does. Plain objects underneath (the
    balancer and the ejector); this class feeds them and logs the ejector's decisions once."""

    def __init__(
        self, model: str, balancer: P2CBalancer, ejector: OutlierEjector, rng: random.Random
    ) -> None:
        self.model = model
        self.balancer = balancer
        self.ejector = ejector
        self.rng = rng

    def free_workers(
        self, workers: list[WorkerConnection]
    ) -> tuple[list[WorkerConnection], list[WorkerConnection]]:
        """Ready workers that may take a batch now: idle ones, and busy ones with a free staging slot.
        Ejected workers sit out (unless all are: then they work rather than stall the model); a probing
        worker takes one batch at a time; nobody goes over the balancer's per-worker cap."""
        ready = [w for w in workers if w.state is WorkerState.READY]
        pool = [w for w in ready if self.ejector.health(w.worker_id) is not Health.EJECTED] or ready
        fits = [w for w in pool if self.balancer.eligible(self.candidate(w))]
        idle = [w for w in fits if w.idle]
        staging = [w for w in fits if w.stage_free and self.ejector.health(w.worker_id) is Health.READY]
        return idle, staging

    def candidate(self, worker: WorkerConnection) -> Candidate:
        """A ready worker as the balancer sees it: suspect while probing (or ejected with the whole fleet)."""
        in_service = self.ejector.health(worker.worker_id) is Health.READY
        return Candidate(
            worker.worker_id, Health.READY if in_service else Health.PROBING, len(worker.inflight)
        )

    def choose(self, workers: list[WorkerConnection]) -> WorkerConnection:
        """Power of two choices among `workers` (all eligible, at least one)."""
        choice = self.balancer.choose([self.candidate(w) for w in workers], self.rng)
        if choice is None:
            raise RuntimeError(
                f"model '{self.model}': no eligible worker among {[w.worker_id for w in workers]}"
            )
        return next(w for w in workers if w.worker_id == choice.worker_id)

    def observe(self, worker_id: str, msg: p.BatchDone, held_s: float) -> None:
        """Feed the balancer and the ejector. Latency is how long the batch held the worker (from reaching
        the device, or the end of the batch before it, to the answer: IPC included), never less than the
        worker's own compute time. Failed batches feed no latency: failing fast must not attract traffic."""
        if msg.batch_error is not None:
            self.note(self.ejector.failure(worker_id))
            return
        latency_s = max(msg.compute_s, held_s)
        self.note(self.ejector.observe(worker_id, latency_s))
        self.balancer.observe(worker_id, latency_s)

    def overdue(self, worker_id: str, age_s: float) -> None:
        """The worker's running batch is far past its expected time (the watchdog hedged it)."""
        self.note(self.ejector.overdue(worker_id, age_s))

    def note(self, change: HealthChange | None) -> None:
        if change is None:
            return
        if change.health is Health.READY:
            self.balancer.forget(change.target)  # its slow history no longer describes it
        log.warning("model %s: %s", self.model, change)

    def join(self, worker_id: str) -> None:
        self.ejector.add(worker_id)

    def leave(self, worker_id: str) -> None:
        """The worker takes no more work (draining or lost): it leaves the fleet the ejector counts."""
        self.balancer.forget(worker_id)
        for change in self.ejector.remove(worker_id):
            self.note(change)

    def ejection(self, worker_id: str) -> EjectionRecord:
        return self.ejector.status(worker_id)


class Dispatcher:
    """Cuts batches when the batching policy says they are due and sends each to a chosen worker."""

    def __init__(self, state: ModelState, routing: Routing, policy: BatchPolicy, mix: MixPolicy) -> None:
        self.state = state
        self.routing = routing
        self.policy = policy
        self.mix = mix

    async def run(self) -> None:
        """The dispatch loop: send what is due, then sleep until the next event or the next cut time."""
        wake = self.state.wake
        while True:
            wake_at = self.dispatch_due()
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
        while True:
            now = self.state.clock.now()
            idle, staging = self.routing.free_workers(self.state.workers)
            if self.state.isolation and (idle or staging):  # retried work first, to any free slot
                self._dispatch_isolated(self.routing.choose(idle or staging), now)
                continue
            decision = self.policy.decide(now, len(queue), queue.oldest_at(), len(idle), len(staging))
            if not decision.size:
                return decision.wake_at
            if not decision.idle and queue.live_in(INTERACTIVE) < decision.size:
                return None  # stage only all-interactive batches: interactive work never waits behind bulk
            worker = self.routing.choose(idle if decision.idle else staging)
            items, expired = self._cut_for(worker, decision.size, now)
            self._expire_cut(expired, now)
            self._send(worker, items, now)

    def _cut_for(
        self, worker: WorkerConnection, size: int, now: float
    ) -> tuple[list[QueuedItem], list[QueuedItem]]:
        """Interactive items first, then bulk, up to the mix policy's cap (batching/mix.py)."""
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
        return queue.cut(size, now)

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
        worker.send_batch(batch)
        self.state.metrics.observe_batch_cut(
            len(items), self.state.config.max_batch_size, [now - i.enqueued_at for i in items]
        )
