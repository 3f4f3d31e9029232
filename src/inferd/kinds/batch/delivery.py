"""Delivery and recovery: a worker's answer settles each item of its batch; a failed batch or a lost worker
has its items retried, isolated or failed (kinds/batch/recovery.py decides which).

deliver (settle each item) <- on_batch_done -> recover (model error: isolate / fail)
recover_lost (a worker's running batch: retry / isolate / fail; its staged batch: back to the queue, or
fail when the model is not idempotent)
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferd.errors import ModelError, ModelOutputError, ServingError, WorkerUnavailable
from inferd.kinds.batch.queue import ItemState, QueuedItem, RequestQueue
from inferd.kinds.batch.recovery import FailureKind, RecoveryPlan, RecoveryPolicy
from inferd.kinds.batch.state import ModelState
from inferd.observability import tracing
from inferd.wire import protocol as p
from inferd.wire.connection import Batch, WorkerConnection

if TYPE_CHECKING:
    from inferd.kinds.batch.worker_choice import Routing

log = logging.getLogger("inferd.dispatcher")

BUSY_WINDOW_S = 10.0
"""The window over which the devices' busy ratio is measured."""


@dataclass(frozen=True, slots=True)
class ItemResult:
    """One item's outputs and its lifecycle record."""

    outputs: dict[str, Any]
    version: int
    batch_id: int
    batch_size: int
    queue_s: float
    compute_s: float
    attempts: int


def settle(fut: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():  # caller left, or already settled
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def owned(batch: Batch) -> list[QueuedItem]:
    """The batch's items it still answers for: unanswered, and not hedged away to a newer batch."""
    return [i for i in batch.items if i.batch_id == batch.batch_id and not i.reply.done()]


def retire(queue: RequestQueue, item: QueuedItem) -> None:
    """The item is answered; a hedged copy of it still queued leaves the queue."""
    if item.state is ItemState.QUEUED:
        queue.withdraw(item)
    item.state = ItemState.DONE


def fail(queue: RequestQueue, item: QueuedItem, exc: ServingError) -> None:
    retire(queue, item)
    settle(item.reply, exc=exc)


class Delivery:
    """Settles answered batches and recovers failed ones. Also the record of completions: when the model
    last made progress, and how busy its devices were."""

    def __init__(self, state: ModelState, routing: Routing, recovery: RecoveryPolicy) -> None:
        self.state = state
        self.routing = routing
        self.recovery = recovery
        self.last_completion = state.clock.now()
        self._busy: deque[tuple[float, float]] = deque()

    # ---- deliver -----------------------------------------------------------------------------------
    def on_batch_done(self, worker: WorkerConnection, msg: p.BatchDone) -> None:
        batch = worker.inflight.pop(msg.batch_id, None)
        if batch is None:
            log.warning("worker %s answered unknown batch %d; ignored", worker.worker_id, msg.batch_id)
            return
        self._record_completion(worker, batch, msg)
        if batch.span is not None:
            tracing.end_batch(batch.span, msg.compute_s, msg.batch_error and msg.batch_error[1])
        if msg.batch_error is not None and msg.batch_error[0] == "ModelOutputError":
            for item in owned(batch):  # a broken contract, not a bad input: nothing to isolate
                self.fail(item, ModelOutputError(msg.batch_error[1]))
        elif msg.batch_error is not None:
            pending = owned(batch)
            self.apply(self.recovery.on_failure(pending, FailureKind.MODEL_ERROR, msg.batch_error[1]))
        else:
            self._deliver(batch, msg, worker.version)
        self.state.wake.set()

    def _record_completion(self, worker: WorkerConnection, batch: Batch, msg: p.BatchDone) -> None:
        now = self.state.clock.now()
        self.routing.observe(worker.worker_id, msg, now - max(batch.sent_at, worker.running_since))
        worker.completed_batches += 1
        worker.last_progress = worker.last_heartbeat = now
        worker.running_since = now
        worker.busy_s += msg.compute_s
        self.last_completion = now
        self._busy.append((now, msg.compute_s))
        self._trim_busy(now)  # bounded whether or not anyone reads busy_ratio()
        self.state.estimator.observe_batch(len(batch.items), now - batch.sent_at)
        self.state.metrics.observe_batch_done(msg.compute_s, "model_error" if msg.batch_error else "ok")

    def _deliver(self, batch: Batch, msg: p.BatchDone, version: int) -> None:
        size = len(batch.items)
        for index, item in enumerate(batch.items):
            error = msg.item_errors.get(index)
            if error is not None:
                self.fail(item, ModelError(error[1]))
                continue
            retire(self.state.queue, item)
            settle(
                item.reply,
                ItemResult(
                    msg.outputs[index],
                    version,
                    batch.batch_id,
                    size,
                    batch.sent_at - item.enqueued_at,
                    msg.compute_s,
                    item.attempts,
                ),
            )

    def fail(self, item: QueuedItem, exc: ServingError) -> None:
        fail(self.state.queue, item, exc)

    def fail_waiting(self, exc: ServingError) -> None:
        """Every queued and isolated item gets `exc` (shutdown, or the dispatch loop failed)."""
        for item in self.state.queue.drain_all():
            self.fail(item, exc)
        while self.state.isolation:
            for item in self.state.isolation.popleft():
                self.fail(item, exc)

    # ---- recover -------------------------------------------------------------------------------------
    def recover_lost(self, worker: WorkerConnection, batches: list[Batch], reason: str) -> None:
        """The batches a lost worker held (running first): the running one is recovered (retry, isolate
        or fail), a batch staged behind it goes back to the head of the queue untouched (or fails, for a
        model that is not idempotent: the worker may have run it)."""
        if not batches:
            self.state.wake.set()
            return
        if self.state.stopping:
            for batch in batches:
                for item in owned(batch):
                    self.fail(item, WorkerUnavailable(f"model '{self.state.name}' is shutting down"))
            return
        kind = FailureKind.HANG if worker.failure else FailureKind.CRASH
        for batch in batches:
            if batch.span is not None:
                tracing.end_batch(batch.span, None, f"worker {worker.worker_id} lost: {reason}")
        running, staged = batches[0], batches[1:]
        self.state.metrics.batch_failed(kind.value)
        detail = f"worker {worker.worker_id} {worker.failure or reason}"
        self.apply(self.recovery.on_staged_lost([i for b in staged for i in owned(b)], detail))
        self.apply(self.recovery.on_failure(owned(running), kind, detail))
        self.state.wake.set()

    def apply(self, plan: RecoveryPlan) -> None:
        metrics = self.state.metrics
        self.state.queue.push_front(plan.requeue)
        if plan.retry:
            self.state.queue.push_front(plan.retry)
            metrics.retried_items(len(plan.retry))
        for group in reversed(plan.isolate):
            for item in group:
                item.state = ItemState.HELD
            self.state.isolation.appendleft(group)
        if plan.isolate:
            metrics.isolation_batches(len(plan.isolate))
        if plan.budget_exhausted:
            metrics.budget_exhausted()
        for item, exc in plan.fail:
            self.fail(item, exc)

    # ---- progress ------------------------------------------------------------------------------------
    def stalled(self) -> bool:
        """Health is forward progress: work is waiting or running, yet nothing completed for a while."""
        s = self.state
        busy = len(s.queue) > 0 or bool(s.isolation) or any(w.inflight for w in s.workers)
        return busy and s.clock.now() - self.last_completion > s.config.progress_timeout_s

    def _trim_busy(self, now: float) -> None:
        while self._busy and self._busy[0][0] < now - BUSY_WINDOW_S:
            self._busy.popleft()

    def busy_ratio(self) -> float:
        """Share of the last BUSY_WINDOW_S the model's devices spent computing."""
        now = self.state.clock.now()
        self._trim_busy(now)
        workers = max(1, len(self.state.workers))
        return min(1.0, sum(c for _, c in self._busy) / (BUSY_WINDOW_S * workers))
