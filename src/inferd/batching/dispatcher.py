"""The asyncio driver of one model: admission, the queue, cutting batches for workers, settling replies,
and recovering from failed batches and workers.

receive (enqueue) -> schedule (policy.decide) -> run (send to a worker) -> deliver (settle each item)
                                                                       -> recover (retry / isolate / fail)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from inferd.batching.admission import DrainEstimator, check_admission
from inferd.batching.mix import MixInput, MixPolicy
from inferd.batching.policy import BatchPolicy
from inferd.batching.queue import BULK, INTERACTIVE, ItemState, QueuedItem, RequestQueue
from inferd.batching.recovery import FailureKind, RecoveryPlan, RecoveryPolicy
from inferd.batching.retry import RetryBudget
from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.errors import (
    DeadlineExceeded,
    ModelError,
    ModelOutputError,
    Overloaded,
    ServingError,
    WorkerUnavailable,
)
from inferd.observability.metrics import ModelMetrics
from inferd.routing import Candidate, EjectionRecord, Health, HealthChange, OutlierEjector, P2CBalancer
from inferd.worker import protocol as p
from inferd.worker.connection import MAX_INFLIGHT, Batch, WorkerConnection, WorkerState

log = logging.getLogger("inferd.dispatcher")

_batch_ids = itertools.count(1)
BUSY_WINDOW_S = 10.0
WATCHDOG_INTERVAL_S = 0.1
HEDGE_FACTOR = 3.0
"""A batch running this many times its expected time is hedged to other workers."""
MAX_LOOP_LAG_S = 0.05
"""Event loop lag (EWMA) past which bulk requests are refused at once; interactive ones past twice that."""

KillWorker = Callable[[WorkerConnection], None]


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


class ModelRuntime:
    """Everything one model needs on the front end: queue, policy, workers and the dispatch loop."""

    def __init__(
        self,
        config: ModelConfig,
        clock: Clock,
        metrics: ModelMetrics,
        budget: RetryBudget,
        kill_worker: KillWorker,
        heartbeat_timeout_s: float = 5.0,
        balancer: P2CBalancer | None = None,
        ejector: OutlierEjector | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.clock = clock
        self.metrics = metrics
        self.budget = budget
        self.kill_worker = kill_worker
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.policy = BatchPolicy(config.max_batch_size, config.max_wait_s, config.preferred_batch_sizes)
        self.recovery = RecoveryPolicy(config.name, budget, config.idempotent, config.max_attempts)
        self.queue = RequestQueue(config.max_queue_size)
        self.isolation: deque[list[QueuedItem]] = deque()
        self.estimator = DrainEstimator(config.max_batch_size)
        self.mix = MixPolicy(config.max_batch_size, config.mixed_batch_cost_ratio)
        self.workers: list[WorkerConnection] = []
        self.balancer = balancer or P2CBalancer(MAX_INFLIGHT)
        self.ejector = ejector or OutlierEjector(clock)
        self.rng = rng or random.Random(0)  # seeded: routing replays the same way; inject another to vary
        self.last_completion = clock.now()
        self._wake = asyncio.Event()
        self._membership = asyncio.Event()
        self.loop_lag_s = 0.0
        """EWMA of how late the watchdog's timer fired: the front end's own saturation."""
        self.max_loop_lag_s = MAX_LOOP_LAG_S
        self.enqueued_total = 0
        """Items admitted since start (the autoscaler's arrival rate)."""
        self._busy: deque[tuple[float, float]] = deque()
        self._stopping = False

    # ---- readiness -------------------------------------------------------------------------------
    @property
    def ready_workers(self) -> int:
        return sum(1 for w in self.workers if w.state is WorkerState.READY)

    @property
    def ready(self) -> bool:
        return self.ready_workers > 0 and not self.stalled()

    def stalled(self) -> bool:
        """Health is forward progress: work is waiting or running, yet nothing completed for a while."""
        busy = len(self.queue) > 0 or bool(self.isolation) or any(w.inflight for w in self.workers)
        return busy and self.clock.now() - self.last_completion > self.config.progress_timeout_s

    @property
    def served_version(self) -> int:
        return self.config.version

    # ---- receive -----------------------------------------------------------------------------------
    def capacity(self, priority: int) -> int:
        """Queue room a class may fill: bulk leaves a reserve for interactive work, so it is shed first."""
        if priority == INTERACTIVE:
            return self.queue.max_size
        reserve = max(self.config.max_batch_size, self.queue.max_size // 4)
        return max(1, self.queue.max_size - reserve)

    def precheck(self, priority: int = INTERACTIVE) -> None:
        """Cheap checks before the body is read: no worker, or no room even for one item."""
        if self._stopping:
            raise WorkerUnavailable(f"model '{self.name}' is shutting down")
        if self.ready_workers == 0:
            raise WorkerUnavailable(f"model '{self.name}' has no ready worker; retry shortly")
        if (
            self.loop_lag_s > self.max_loop_lag_s and priority != INTERACTIVE
        ) or self.loop_lag_s > 2 * self.max_loop_lag_s:
            # The front end's CPU is saturated: refuse before reading the body (bulk first), or the
            # excess would wait in socket buffers with unbounded latency instead of getting a 429.
            raise Overloaded(
                f"the front end is saturated (event loop {1000 * self.loop_lag_s:.0f} ms behind); "
                "retry in 1 s",
                retry_after_s=1.0,
                reason="front_end_saturated",
            )
        if len(self.queue) >= self.capacity(priority):
            check_admission(
                self.name,
                len(self.queue),
                self.capacity(priority),
                1,
                self.clock.now(),
                None,
                self.estimator,
                self.ready_workers,
            )

    def enqueue(
        self, payloads: Sequence[Any], deadline: float | None, priority: int = INTERACTIVE
    ) -> list[QueuedItem]:
        """Admit and queue one request's items. Raises Overloaded or WorkerUnavailable."""
        self.precheck(priority)
        now = self.clock.now()
        check_admission(
            self.name,
            len(self.queue),
            self.capacity(priority),
            len(payloads),
            now,
            deadline,
            self.estimator,
            self.ready_workers,
        )
        loop = asyncio.get_running_loop()
        items = [
            QueuedItem(payload, now, deadline, loop.create_future(), priority=priority)
            for payload in payloads
        ]
        for item in items:
            self.queue.push(item)
        self.budget.record_requests(len(items))
        self.enqueued_total += len(items)
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
            )

    # ---- schedule / run ------------------------------------------------------------------------------
    async def run(self) -> None:
        """The dispatch loop. Runs until cancelled."""
        while True:
            wake_at = self.dispatch_due()
            self._wake.clear()
            if wake_at is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, wake_at - self.clock.now())):
                        await self._wake.wait()

    def dispatch_due(self) -> float | None:
        """Send every batch that is due now; return when to look again (None: at the next event)."""
        while True:
            now = self.clock.now()
            idle, staging = self._free_workers()
            if self.isolation and (idle or staging):  # retried work first, to any free slot
                self._dispatch_isolated(self._choose(idle or staging), now)
                continue
            decision = self.policy.decide(
                now, len(self.queue), self.queue.oldest_at(), len(idle), len(staging)
            )
            if not decision.size:
                return decision.wake_at
            if not decision.idle and self.queue.live_in(INTERACTIVE) < decision.size:
                return None  # stage only all-interactive batches: interactive work never waits behind bulk
            worker = self._choose(idle if decision.idle else staging)
            items, expired = self._cut_for(worker, decision.size, now)
            self._expire_cut(expired, now)
            self._send(worker, items, now)

    def _cut_for(
        self, worker: WorkerConnection, size: int, now: float
    ) -> tuple[list[QueuedItem], list[QueuedItem]]:
        """Interactive items first, then bulk, up to the mix policy's cap (batching/mix.py)."""
        bulk = self.queue.live_in(BULK)
        line = self.estimator.cost_line() if bulk else None
        if line is not None:  # the cap only ever limits batches that bulk could fill
            cap = self.mix.cap(
                MixInput(
                    now,
                    self.queue.live_in(INTERACTIVE),
                    bulk,
                    self.queue.last_arrival[INTERACTIVE],
                    line,
                    self._other_finishes(worker, line),
                )
            )
            size = min(size, cap)
        return self.queue.cut(size, now)

    def _other_finishes(self, worker: WorkerConnection, line: tuple[float, float]) -> list[float]:
        """When the other busy workers are expected to finish what they hold (from the cost line)."""
        base, per_item = line
        return [
            w.running_since + sum(base + per_item * len(b.items) for b in w.inflight.values())
            for w in self.workers
            if w is not worker and w.inflight and w.state is WorkerState.READY
        ]

    def _free_workers(self) -> tuple[list[WorkerConnection], list[WorkerConnection]]:
        """Ready workers that may take a batch now: idle ones, and busy ones with a free staging slot.
        Ejected workers sit out (unless all are: then they work rather than stall the model); a probing
        worker takes one batch at a time; nobody goes over the balancer's per-worker cap."""
        ready = [w for w in self.workers if w.state is WorkerState.READY]
        pool = [w for w in ready if self.ejector.health(w.worker_id) is not Health.EJECTED] or ready
        fits = [w for w in pool if self.balancer.eligible(self._candidate(w))]
        idle = [w for w in fits if w.idle]
        staging = [w for w in fits if w.stage_free and self.ejector.health(w.worker_id) is Health.READY]
        return idle, staging

    def _candidate(self, worker: WorkerConnection) -> Candidate:
        """A ready worker as the balancer sees it: READY in service, else PROBING (also when all are ejected)."""
        in_service = self.ejector.health(worker.worker_id) is Health.READY
        return Candidate(
            worker.worker_id, Health.READY if in_service else Health.PROBING, len(worker.inflight)
        )

    def _choose(self, workers: list[WorkerConnection]) -> WorkerConnection:
        """Power of two choices among `workers` (all eligible, at least one)."""
        choice = self.balancer.choose([self._candidate(w) for w in workers], self.rng)
        if choice is None:
            raise RuntimeError(
                f"model '{self.name}': no eligible worker among {[w.worker_id for w in workers]}"
            )
        return next(w for w in workers if w.worker_id == choice.worker_id)

    def _dispatch_isolated(self, worker: WorkerConnection, now: float) -> None:
        group = self.isolation.popleft()
        live = [i for i in group if not i.reply.done()]
        expired = [i for i in live if i.deadline is not None and i.deadline <= now]
        self._expire_cut(expired, now)
        self._send(worker, [i for i in live if i not in expired], now)

    def _expire_cut(self, expired: list[QueuedItem], now: float) -> None:
        for item in expired:
            self._fail(
                item,
                DeadlineExceeded(
                    f"request to model '{self.name}' expired after {1000 * (now - item.first_enqueued_at):.0f} ms "
                    "before a batch slot was free"
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
        self._observe_route(worker, msg, now - max(batch.sent_at, worker.running_since))
        worker.completed_batches += 1
        worker.last_progress = worker.last_heartbeat = now
        worker.running_since = now
        worker.busy_s += msg.compute_s
        self.last_completion = now
        self._busy.append((now, msg.compute_s))
        self.estimator.observe_batch(len(batch.items), now - batch.sent_at)
        self.metrics.observe_batch_done(msg.compute_s, "model_error" if msg.batch_error else "ok")
        if msg.batch_error is not None and msg.batch_error[0] == "ModelOutputError":
            for item in owned(batch):  # a broken contract, not a bad input: nothing to isolate
                self._fail(item, ModelOutputError(msg.batch_error[1]))
        elif msg.batch_error is not None:
            pending = owned(batch)
            self._apply(self.recovery.on_failure(pending, FailureKind.MODEL_ERROR, msg.batch_error[1]))
        else:
            self._deliver(batch, msg, worker.version)
        self._wake.set()

    def _observe_route(self, worker: WorkerConnection, msg: p.BatchDone, held_s: float) -> None:
        """Feed the balancer and the ejector. Latency is how long the batch held the worker (from reaching
        the device, or the end of the batch before it, to the answer: IPC included), never less than the
        worker's own compute time. Failed batches feed no latency: failing fast must not attract traffic."""
        wid = worker.worker_id
        if msg.batch_error is not None:
            self._note(self.ejector.failure(wid))
            return
        latency_s = max(msg.compute_s, held_s)
        self._note(self.ejector.observe(wid, latency_s))
        self.balancer.observe(wid, latency_s)

    def _note(self, change: HealthChange | None) -> None:
        if change is None:
            return
        if change.health is Health.READY:
            self.balancer.forget(change.target)  # its slow history no longer describes it
        log.warning("model %s: %s", self.name, change)

    def ejection_status(self, worker: WorkerConnection) -> EjectionRecord:
        """The worker's outlier-ejection record (state, times ejected, until when), for the admin API."""
        return self.ejector.status(worker.worker_id)

    def _deliver(self, batch: Batch, msg: p.BatchDone, version: int) -> None:
        size = len(batch.items)
        for index, item in enumerate(batch.items):
            error = msg.item_errors.get(index)
            if error is not None:
                self._fail(item, ModelError(error[1]))
                continue
            self._retire(item)
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

    def _fail(self, item: QueuedItem, exc: ServingError) -> None:
        self._retire(item)
        settle(item.reply, exc=exc)

    def _retire(self, item: QueuedItem) -> None:
        """The item is answered; a hedged copy of it still queued leaves the queue."""
        if item.state is ItemState.QUEUED:
            self.queue.withdraw(item)
        item.state = ItemState.DONE

    # ---- recover -------------------------------------------------------------------------------------
    def on_worker_lost(self, worker: WorkerConnection, reason: str) -> None:
        """The connection broke or the process exited: the batch it was running is recovered (retry,
        isolate or fail), a batch staged behind it goes back to the head of the queue untouched."""
        if worker in self.workers:
            self.workers.remove(worker)
        self._leave_routing(worker)
        was = worker.state
        self._membership_changed()
        worker.close()
        batches = list(worker.inflight.values())
        worker.inflight.clear()
        kind = FailureKind.HANG if worker.failure else FailureKind.CRASH
        detail = f"worker {worker.worker_id} {worker.failure or reason}"
        if was is not WorkerState.DEAD:
            log.warning(
                "worker %s (pid %d) of model %s lost: %s; %d batch(es) in flight",
                worker.worker_id,
                worker.pid,
                self.name,
                worker.failure or reason,
                len(batches),
            )
        if not batches:
            self._wake.set()
            return
        running, staged = batches[0], batches[1:]
        if self._stopping:
            for batch in batches:
                for item in owned(batch):
                    self._fail(item, WorkerUnavailable(f"model '{self.name}' is shutting down"))
            return
        self.metrics.batch_failed(kind.value)
        staged_items = [i for b in staged for i in owned(b)]
        for item in staged_items:
            item.attempts -= 1  # sent, never run
        self.queue.push_front(staged_items)
        self._apply(self.recovery.on_failure(owned(running), kind, detail))
        self._wake.set()

    def _leave_routing(self, worker: WorkerConnection) -> None:
        """The worker takes no more work (draining or lost): it leaves the fleet the ejector counts."""
        self.balancer.forget(worker.worker_id)
        for change in self.ejector.remove(worker.worker_id):
            self._note(change)

    def _apply(self, plan: RecoveryPlan) -> None:
        if plan.retry:
            self.queue.push_front(plan.retry)
            self.metrics.retried_items(len(plan.retry))
        for group in reversed(plan.isolate):
            for item in group:
                item.state = ItemState.HELD
            self.isolation.appendleft(group)
        if plan.isolate:
            self.metrics.isolation_batches(len(plan.isolate))
        if plan.budget_exhausted:
            self.metrics.budget_exhausted()
        for item, exc in plan.fail:
            self._fail(item, exc)

    async def watchdog(self) -> None:
        """Kill workers whose batch hangs or that went silent; the broken connection then recovers their
        batches like any crash. Also measures the event loop's lag: how late this loop's own timer fires
        tells whether the front end itself is saturated."""
        while True:
            started = time.perf_counter()
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            self.loop_lag_s += 0.3 * (
                max(0.0, time.perf_counter() - started - WATCHDOG_INTERVAL_S) - self.loop_lag_s
            )
            self.check_workers()

    def check_workers(self) -> None:
        now = self.clock.now()
        limit = self.batch_timeout_s()
        for w in list(self.workers):
            if w.failure:
                continue
            if w.inflight:
                self._hedge_if_slow(w, now)
            if w.inflight and now - w.running_since > limit:
                w.failure = (
                    f"hung: a batch ran {now - w.running_since:.1f}s, over the {limit:.1f}s batch timeout"
                )
            elif now - w.last_heartbeat > self.heartbeat_timeout_s:
                w.failure = f"went silent: no heartbeat for {now - w.last_heartbeat:.1f}s"
            else:
                continue
            log.warning(
                "killing worker %s (pid %d) of model %s: %s", w.worker_id, w.pid, self.name, w.failure
            )
            self.kill_worker(w)

    def _hedge_if_slow(self, worker: WorkerConnection, now: float) -> None:
        """A batch running over HEDGE_FACTOR x its expected time (from the fleet's cost line), and slow
        against the other workers too (a fleet-wide slowdown is not hedged: copies would only add load):
        the worker is ejected at once if the share allows, and the batch's items go back to the head of
        the queue for another worker. The first answer wins; inference is idempotent, so a model that is
        not gets no hedges.

        Bounded: an item is hedged at most once and within max_attempts; items under suspicion (they
        crashed a worker before, or are being isolated as a possible poison input) are never hedged, so a
        hanging input is not spread over the fleet and isolation is never undone. Running items spend the
        retry budget; staged items, which never started, go back free (as when a worker is lost)."""
        running, *staged = worker.inflight.values()
        line = self.estimator.cost_line()
        if running.hedged or line is None or not self.config.idempotent:
            return
        expected = line[0] + line[1] * len(running.items)
        age = now - worker.running_since
        if age < HEDGE_FACTOR * expected or not self.ejector.is_slow(worker.worker_id, age):
            return
        if not any(w is not worker and w.state is WorkerState.READY for w in self.workers):
            return
        self._note(self.ejector.overdue(worker.worker_id, age))
        for batch in (running, *staged):
            batch.hedged = True
        first = [i for i in owned(running) if self._hedgeable(i)]
        later = [i for b in staged for i in owned(b) if self._hedgeable(i)]
        if first and not self.budget.try_spend(len(first)):
            first = []
        items = first + later
        if not items:
            return
        for item in items:
            item.batch_id = 0
            item.hedged = True
        self.queue.push_front(items)
        self.metrics.retried_items(len(first))
        log.warning(
            "model %s: worker %s has run a batch for %.2fs (expected %.2fs): %d item(s) hedged to others",
            self.name,
            worker.worker_id,
            age,
            expected,
            len(items),
        )
        self._wake.set()

    def _hedgeable(self, item: QueuedItem) -> bool:
        return (
            not item.hedged
            and item.crashes == 0
            and item.isolation_round == 0
            and item.attempts < self.config.max_attempts
        )

    def batch_timeout_s(self) -> float:
        if self.config.batch_timeout_s is not None:
            return self.config.batch_timeout_s
        latency = self.estimator.batch_latency_s
        return 30.0 if latency is None else max(1.0, 10.0 * latency)

    # ---- workers ------------------------------------------------------------------------------------
    def add_worker(self, worker: WorkerConnection) -> None:
        worker.state = WorkerState.READY
        worker.last_progress = worker.last_heartbeat = self.clock.now()
        self.workers.append(worker)
        self.ejector.add(worker.worker_id)
        log.info(
            "worker %s (pid %d) of model %s v%d is ready",
            worker.worker_id,
            worker.pid,
            self.name,
            worker.version,
        )
        self._membership_changed()
        self._wake.set()

    async def membership_changed(self) -> None:
        """Returns at the next worker arrival or departure (for fleet operations that wait on one)."""
        await self._membership.wait()

    def _membership_changed(self) -> None:
        self._membership.set()
        self._membership = asyncio.Event()

    def drain_worker(self, worker: WorkerConnection) -> None:
        """No new batches; the worker finishes what it holds, then exits (and is replaced)."""
        if worker.state is WorkerState.READY:
            worker.state = WorkerState.DRAINING
            worker.send(p.Drain())
            self._leave_routing(worker)
            log.info("draining worker %s (pid %d) of model %s", worker.worker_id, worker.pid, self.name)
            self._wake.set()

    # ---- stats ---------------------------------------------------------------------------------------
    def busy_ratio(self) -> float:
        now = self.clock.now()
        while self._busy and self._busy[0][0] < now - BUSY_WINDOW_S:
            self._busy.popleft()
        workers = max(1, len(self.workers))
        return min(1.0, sum(c for _, c in self._busy) / (BUSY_WINDOW_S * workers))

    def fail_all_queued(self, exc: ServingError) -> None:
        for item in self.queue.drain_all():
            self._fail(item, exc)
        while self.isolation:
            for item in self.isolation.popleft():
                self._fail(item, exc)

    def stop_accepting(self) -> None:
        self._stopping = True
