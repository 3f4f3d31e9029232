"""The asyncio driver of one model: admission, the queue, cutting batches for workers, settling replies.

receive (enqueue) -> schedule (policy.decide) -> run (send to a worker) -> deliver (settle each item)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferd.batching.admission import DrainEstimator, check_admission, retry_after_s
from inferd.batching.policy import BatchPolicy
from inferd.batching.queue import ItemState, QueuedItem, RequestQueue
from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.errors import (
    DeadlineExceeded,
    ModelError,
    ServingError,
    WorkerDied,
    WorkerUnavailable,
    from_wire,
)
from inferd.observability.metrics import ModelMetrics
from inferd.worker import protocol as p
from inferd.worker.connection import Batch, WorkerConnection, WorkerState

log = logging.getLogger("inferd.dispatcher")

_batch_ids = itertools.count(1)
BUSY_WINDOW_S = 10.0


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


class ModelRuntime:
    """Everything one model needs on the front end: queue, policy, workers and the dispatch loop."""

    def __init__(
        self, config: ModelConfig, clock: Clock, metrics: ModelMetrics, max_attempts: int = 3
    ) -> None:
        self.config = config
        self.name = config.name
        self.clock = clock
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.policy = BatchPolicy(config.max_batch_size, config.max_wait_s, config.preferred_batch_sizes)
        self.queue = RequestQueue(config.max_queue_size)
        self.estimator = DrainEstimator(config.max_batch_size)
        self.workers: list[WorkerConnection] = []
        self._wake = asyncio.Event()
        self._busy: deque[tuple[float, float]] = deque()
        self._stopping = False

    # ---- readiness -------------------------------------------------------------------------------
    @property
    def ready_workers(self) -> int:
        return sum(1 for w in self.workers if w.state is WorkerState.READY)

    @property
    def ready(self) -> bool:
        return self.ready_workers > 0

    @property
    def served_version(self) -> int:
        return self.config.version

    # ---- receive -----------------------------------------------------------------------------------
    def precheck(self) -> None:
        """Cheap checks before the body is read: no worker, or no room even for one item."""
        if self._stopping:
            raise WorkerUnavailable(f"model '{self.name}' is shutting down")
        if not self.ready:
            raise WorkerUnavailable(f"model '{self.name}' has no ready worker; retry shortly")
        if self.queue.free() <= 0:
            check_admission(
                self.name,
                len(self.queue),
                self.queue.max_size,
                1,
                self.clock.now(),
                None,
                self.estimator,
                self.ready_workers,
            )

    def enqueue(self, payloads: Sequence[Any], deadline: float | None) -> list[QueuedItem]:
        """Admit and queue one request's items. Raises Overloaded or WorkerUnavailable."""
        self.precheck()
        now = self.clock.now()
        check_admission(
            self.name,
            len(self.queue),
            self.queue.max_size,
            len(payloads),
            now,
            deadline,
            self.estimator,
            self.ready_workers,
        )
        loop = asyncio.get_running_loop()
        items = [QueuedItem(payload, now, deadline, loop.create_future()) for payload in payloads]
        for item in items:
            self.queue.push(item)
        self._wake.set()
        return items

    def withdraw(self, items: Sequence[QueuedItem]) -> None:
        """The caller left: queued items never reach a worker; running ones are answered to nobody."""
        for item in items:
            self.queue.withdraw(item)
            item.reply.cancel()

    def expire(self, items: Sequence[QueuedItem]) -> None:
        """The request's deadline passed: every unanswered item gets DeadlineExceeded (504)."""
        now = self.clock.now()
        for item in items:
            if item.reply.done():
                continue
            where = "in the queue" if self.queue.withdraw(item) else "while its batch ran"
            self._fail(
                item,
                DeadlineExceeded(
                    f"request to model '{self.name}' missed its deadline after "
                    f"{1000 * (now - item.first_enqueued_at):.0f} ms {where}"
                ),
                outcome="deadline",
            )

    # ---- schedule / run ------------------------------------------------------------------------------
    async def run(self) -> None:
        """The dispatch loop. Runs until cancelled."""
        while True:
            now = self.clock.now()
            idle = [w for w in self.workers if w.idle]
            staging = [w for w in self.workers if w.stage_free]
            decision = self.policy.decide(
                now, len(self.queue), self.queue.oldest_at(), len(idle), len(staging)
            )
            if decision.size:
                worker = min(idle, key=_lru) if decision.idle else min(staging, key=_lru)
                self._dispatch(worker, decision.size, now)
                continue
            self._wake.clear()
            if decision.wake_at is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, decision.wake_at - now)):
                        await self._wake.wait()

    def _dispatch(self, worker: WorkerConnection, size: int, now: float) -> None:
        items, expired = self.queue.cut(size, now)
        for item in expired:
            self._fail(
                item,
                DeadlineExceeded(
                    f"request to model '{self.name}' expired after {1000 * (now - item.first_enqueued_at):.0f} ms "
                    "in the queue before a batch slot was free"
                ),
                outcome="deadline",
            )
        if not items:
            return
        for item in items:
            item.attempts += 1
        batch = Batch(next(_batch_ids), items, now, worker)
        worker.send_batch(batch)
        self.metrics.observe_batch_cut(
            len(items), self.config.max_batch_size, [now - i.enqueued_at for i in items]
        )

    # ---- deliver -----------------------------------------------------------------------------------
    def on_batch_done(self, worker: WorkerConnection, msg: p.BatchDone) -> None:
        batch = worker.inflight.pop(msg.batch_id, None)
        if batch is None:
            log.warning("worker %s answered unknown batch %d; ignored", worker.worker_id, msg.batch_id)
            return
        now = self.clock.now()
        worker.completed_batches += 1
        worker.last_progress = now
        worker.busy_s += msg.compute_s
        self._busy.append((now, msg.compute_s))
        self.estimator.observe_batch(len(batch.items), now - batch.sent_at)
        self.metrics.observe_batch_done(msg.compute_s, "error" if msg.batch_error else "ok")
        if msg.batch_error is not None:
            err = from_wire(*msg.batch_error)
            for item in batch.items:
                self._fail(item, err, outcome="model_error")
        else:
            self._deliver(batch, msg, worker.version)
        self._wake.set()

    def _deliver(self, batch: Batch, msg: p.BatchDone, version: int) -> None:
        size = len(batch.items)
        for index, item in enumerate(batch.items):
            error = msg.item_errors.get(index)
            if error is not None:
                self._fail(item, ModelError(error[1]), outcome="model_error")
                continue
            item.state = ItemState.DONE
            queue_s = batch.sent_at - item.enqueued_at
            settle(
                item.reply,
                ItemResult(
                    msg.outputs[index], version, batch.batch_id, size, queue_s, msg.compute_s, item.attempts
                ),
            )

    def _fail(self, item: QueuedItem, exc: ServingError, outcome: str) -> None:
        item.state = ItemState.DONE
        settle(item.reply, exc=exc)

    # ---- workers ------------------------------------------------------------------------------------
    def add_worker(self, worker: WorkerConnection) -> None:
        worker.state = WorkerState.READY
        worker.last_progress = self.clock.now()
        self.workers.append(worker)
        log.info(
            "worker %s (pid %d) of model %s v%d is ready",
            worker.worker_id,
            worker.pid,
            self.name,
            worker.version,
        )
        self._wake.set()

    def on_worker_lost(self, worker: WorkerConnection, reason: str) -> None:
        """The connection broke or the process exited: its batches are retried or failed, once."""
        if worker in self.workers:
            self.workers.remove(worker)
        was = worker.state
        worker.close()
        batches = list(worker.inflight.values())
        worker.inflight.clear()
        if was is not WorkerState.DEAD:
            log.warning(
                "worker %s (pid %d) of model %s lost (%s); %d batch(es) in flight",
                worker.worker_id,
                worker.pid,
                self.name,
                reason,
                len(batches),
            )
        retry: list[QueuedItem] = []
        for batch in batches:
            for item in batch.items:
                if item.reply.done():
                    continue
                if self.config.idempotent and item.attempts < self.max_attempts and not self._stopping:
                    retry.append(item)
                else:
                    why = (
                        "the model is not idempotent, so it is not retried"
                        if not self.config.idempotent
                        else f"after {item.attempts} attempts"
                    )
                    self._fail(
                        item,
                        WorkerDied(
                            f"worker {worker.worker_id} of model '{self.name}' died running this request's batch "
                            f"({reason}); {why}"
                        ),
                        outcome="worker_died",
                    )
        if retry:
            self.queue.push_front(retry)
            self.metrics.retried_items(len(retry))
        self._wake.set()

    # ---- stats ---------------------------------------------------------------------------------------
    def busy_ratio(self) -> float:
        now = self.clock.now()
        while self._busy and self._busy[0][0] < now - BUSY_WINDOW_S:
            self._busy.popleft()
        workers = max(1, len(self.workers))
        return min(1.0, sum(c for _, c in self._busy) / (BUSY_WINDOW_S * workers))

    def retry_after_s(self) -> int:
        return retry_after_s(self.estimator.drain_time_s(len(self.queue), max(1, self.ready_workers)))

    def fail_all_queued(self, exc: ServingError) -> None:
        for item in self.queue.drain_all():
            self._fail(item, exc, outcome="unavailable")

    def stop_accepting(self) -> None:
        self._stopping = True


def _lru(worker: WorkerConnection) -> float:
    return worker.last_dispatch
