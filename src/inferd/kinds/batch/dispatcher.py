"""ModelRuntime: the batch kind's Runtime (runtime/contract.py), the front end of one batch model.

receive (admit, enqueue) -> dispatch (kinds/batch/dispatch.py: cut a batch, choose a worker)
  -> deliver (kinds/batch/delivery.py: settle each item) or recover (retry / isolate / fail)
watchdog (kinds/batch/watchdog.py: hung and silent workers, hedges, loop lag)
membership (kinds/batch/membership.py: workers join, drain, are lost)
cold (kinds/batch/cold.py: no worker in service: requests held, bounded, while a waker gives it one)

This module wires those parts together and is the one other modules use; it admits requests itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Coroutine, Sequence
from typing import Any, ClassVar

from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.errors import DeadlineExceeded, Internal, ServingError, WorkerUnavailable
from inferd.kinds.batch.admission import DrainEstimator, check_admission, check_loop_lag
from inferd.kinds.batch.cold import ColdAdmission
from inferd.kinds.batch.delivery import Delivery, ItemResult, fail, owned, settle
from inferd.kinds.batch.dispatch import Dispatcher
from inferd.kinds.batch.hedging import HedgePolicy
from inferd.kinds.batch.membership import BatchMembership
from inferd.kinds.batch.mix import MixPolicy
from inferd.kinds.batch.queue import QueuedItem, RequestQueue
from inferd.kinds.batch.recovery import RecoveryPolicy
from inferd.kinds.batch.service import BatchService
from inferd.kinds.batch.slo_policy import batch_policy, queued_ahead
from inferd.kinds.batch.state import ModelState
from inferd.kinds.batch.statistics import BatchStatistics, BatchWorkerDetail
from inferd.kinds.batch.watchdog import KillWorker, Watchdog
from inferd.kinds.batch.worker_choice import Routing
from inferd.observability import tracing
from inferd.observability.metrics import ModelMetrics
from inferd.routing import EjectionRecord, OutlierEjector, P2CBalancer
from inferd.routing.fairness import BULK, INTERACTIVE, NO_TENANT, TenantShare, gave_way, over_share
from inferd.routing.locality import LocalityPolicy
from inferd.routing.retry import RetryBudget
from inferd.runtime.contract import RuntimeStatistics, WorkerSnapshot
from inferd.runtime.membership import Membership
from inferd.runtime.waking import Wakers
from inferd.wire import protocol as p
from inferd.wire.connection import MAX_INFLIGHT, WorkerConnection

__all__ = ["ItemResult", "KillWorker", "ModelRuntime", "settle"]

log = logging.getLogger("inferd.dispatcher")

MAX_LOOP_LAG_S = 0.05
"""Event loop lag (EWMA) past which bulk requests are refused at once; interactive ones past twice that."""


class ModelRuntime:
    """Everything one batch model needs on the front end: queue, policies, workers and its loops."""

    kind: ClassVar[str] = "batch"
    accepts_workers: ClassVar[bool] = True

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
        members: Membership | None = None,
        locality: LocalityPolicy | None = None,
        wakers: Wakers | None = None,
    ) -> None:
        self.name = config.name
        self.clock = clock
        self.metrics = metrics
        self.budget = budget
        self.members = members or Membership(clock)  # the server's WorkerDirectory gives it; alone: its own
        queue, estimator = RequestQueue(config.max_queue_size), DrainEstimator(config.max_batch_size)
        state = ModelState(config, clock, metrics, queue, estimator, workers=self.members.workers)
        routing = Routing(
            config.name,
            balancer or P2CBalancer(MAX_INFLIGHT),
            ejector or OutlierEjector(clock),
            rng or random.Random(0),  # seeded: routing replays the same way; inject another to vary  # nosec B311
            locality,  # the front end's zone first (routing/locality.py); None: no zones
        )
        self._state = state
        self._routing = routing
        self._dispatcher = Dispatcher(
            state,
            routing,
            batch_policy(config, state.estimator, lambda: self.enqueued_total, state.queue.times_since),
            MixPolicy(config.max_batch_size, config.mixed_batch_cost_ratio),
        )
        self._delivery = Delivery(
            state, routing, RecoveryPolicy(config.name, budget, config.idempotent, config.max_attempts)
        )
        hedging = HedgePolicy(clock, budget, routing.ejector)
        self._watchdog = Watchdog(state, routing, hedging, kill_worker, heartbeat_timeout_s)
        self._membership = BatchMembership(state, routing, self.members)
        self._cold = ColdAdmission(state, wakers)  # no worker in service: hold while its waker wakes one
        self.queue = state.queue
        self._ahead = queued_ahead(config, state.queue.count_since)  # None: FIFO, every queued item is ahead
        self.isolation = state.isolation
        self.workers = state.workers
        self.estimator = state.estimator
        self.balancer = routing.balancer
        self.ejector = routing.ejector
        self.max_loop_lag_s = MAX_LOOP_LAG_S
        self.enqueued_total = 0
        self._requests = itertools.count(1)
        """Items admitted since start (the autoscaler's arrival rate)."""
        self.service = BatchService(self)  # how callers queue, wait and withdraw (kinds/batch/service.py)

    # ---- identity and readiness ----------------------------------------------------------------------
    @property
    def config(self) -> ModelConfig:
        return self._state.config

    @config.setter
    def config(self, config: ModelConfig) -> None:
        """A rolling update: workers that connect from now on load this version."""
        self._state.config = config

    @property
    def version(self) -> int:
        return self._state.config.version

    @property
    def ready_workers(self) -> int:
        return self._state.ready_workers()

    @property
    def ready(self) -> bool:
        """Its own readiness (the server's: runtime/readiness.py): a ready worker making progress; with none, whether its waker can give it one on demand now."""
        if self.ready_workers == 0:
            return self._cold.on_demand()
        return not self.stalled()

    def stalled(self) -> bool:
        """Health is forward progress: work is waiting or running, yet nothing completed for a while."""
        return self._delivery.stalled()

    @property
    def loop_lag_s(self) -> float:
        """EWMA of how late the watchdog's timer fired: the front end's own saturation."""
        return self._watchdog.loop_lag_s

    @loop_lag_s.setter
    def loop_lag_s(self, lag_s: float) -> None:
        self._watchdog.loop_lag_s = lag_s

    # ---- receive -----------------------------------------------------------------------------------
    def capacity(self, priority: int) -> int:
        """Queue room a class may fill: bulk leaves a reserve for interactive work, so it is shed first."""
        if priority == INTERACTIVE:
            return self.queue.max_size
        reserve = max(self.config.max_batch_size, self.queue.max_size // 4)
        return max(1, self.queue.max_size - reserve)

    def precheck(self, priority: int = INTERACTIVE, tenant: TenantShare = NO_TENANT) -> int:
        """Cheap checks before the body is read: no worker (and none to wake: kinds/batch/cold.py), or no
        room even for one item of `tenant`. Returns the ready workers it counted (admission reuses them)."""
        if self._state.stopping:
            raise WorkerUnavailable(f"model '{self.name}' is shutting down")
        ready = self.ready_workers
        if ready == 0:
            self._cold.check(1, None)
        check_loop_lag(self.loop_lag_s, self.max_loop_lag_s, priority)
        if len(self.queue) >= self.capacity(priority):
            self._check_room(1, None, priority, ready, tenant)
        return ready

    def _check_room(
        self, n: int, deadline: float | None, priority: int, ready: int, tenant: TenantShare
    ) -> dict[str, int]:
        """Raise Overloaded unless `n` items of `tenant` fit by the deadline; returns the newest items of
        which tenants must give up their place for them (routing/fairness.py)."""
        capacity = self.capacity(priority)
        taken = self.queue.room_for(tenant, n, priority, capacity)
        if taken is None and tenant != NO_TENANT:
            held = self.queue.held_in(priority).get(tenant.name, 0)
            drain = self.estimator.drain_time_s(len(self.queue), ready)
            raise over_share(self.name, len(self.queue), capacity, tenant, held, drain)
        queued, now = len(self.queue) - (sum(taken.values()) if taken else 0), self.clock.now()
        ahead = None if self._ahead is None or deadline is None else min(queued, self._ahead(now))
        check_admission(self.name, queued, capacity, n, now, deadline, self.estimator, ready, ahead)
        return taken or {}

    def enqueue(
        self,
        payloads: Sequence[Any],
        deadline: float | None,
        priority: int = INTERACTIVE,
        tenant: TenantShare = NO_TENANT,
    ) -> list[QueuedItem]:
        """Admit and queue one request's items (kinds/batch/cold.py if no worker). Raises Overloaded or WorkerUnavailable."""
        ready = self.precheck(priority, tenant)
        if ready == 0:
            self._cold.check(len(payloads), deadline)
        taken = self._check_room(len(payloads), deadline, priority, ready, tenant)
        if taken:
            self._displace(priority, taken, tenant, ready)
        now = self.clock.now()
        loop = self._state.running_loop()
        request = next(self._requests)
        trace = tracing.recording_span() if tracing.ENABLED else None
        items = [
            QueuedItem(
                payload,
                now,
                deadline,
                loop.create_future(),
                priority=priority,
                tenant=tenant,
                request=request,
                trace=trace,
            )
            for payload in payloads
        ]
        for item in items:
            self.queue.push(item)
        self.budget.record_requests(len(items))
        self.enqueued_total += len(items)
        if len(self.queue) >= self._state.wake_queued:  # else the dispatch loop's last decision stands
            self._state.wake.set()
        if ready == 0:
            self._cold.held()
        return items

    def _displace(self, priority: int, taken: dict[str, int], tenant: TenantShare, ready: int) -> None:
        """The queue is full and `tenant` is within its share: the newest items of the tenants over
        their shares give up their places (429)."""
        drain = self.estimator.drain_time_s(len(self.queue), ready)
        for item in self.queue.displace(priority, taken):
            fail(self.queue, item, gave_way(self.name, item.tenant, tenant, drain))

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
            fail(
                self.queue,
                item,
                DeadlineExceeded(
                    f"request to model '{self.name}' missed its deadline after "
                    f"{1000 * (now - item.first_enqueued_at):.0f} ms {where}"
                ),
            )

    # ---- loops -------------------------------------------------------------------------------------
    async def run(self) -> None:
        """The dispatch loop and the watchdog, until cancelled. If either fails unexpectedly, the model
        stops accepting, everything queued gets Internal naming the error, and the error is raised (the
        supervisor decides)."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(
                    self._supervised("dispatch loop", self._dispatcher.run()), name=f"dispatch-{self.name}"
                )
                tg.create_task(
                    self._supervised("watchdog", self._watchdog.run()), name=f"watchdog-{self.name}"
                )
                tg.create_task(self._supervised("cold waker", self._cold.run()), name=f"cold-{self.name}")
        except ExceptionGroup as group:  # one loop failed, the other was cancelled: raise its error
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    async def _supervised(self, what: str, loop: Coroutine[Any, Any, None]) -> None:
        try:
            await loop
        except Exception as exc:
            log.exception("%s of model %s failed", what, self.name)
            self.stop(Internal(f"{what} of model '{self.name}' failed: {exc!r}"))
            raise

    def stop(self, exc: ServingError) -> None:
        """Refuse new work and fail every queued and isolated item with `exc`."""
        self._state.stopping = True
        self._delivery.fail_waiting(exc)

    def dispatch_due(self) -> float | None:
        """Send every batch that is due now; return when to look again (None: at the next event)."""
        return self._dispatcher.dispatch_due()

    def report_demand(self) -> None:
        """Tell shared workers what is queued and give back unused slots, as the dispatch loop does after
        each pass (kinds/batch/credit_demand.py)."""
        self._dispatcher.report_demand()

    def check_workers(self) -> None:
        """One watchdog round: hedge slow batches, kill hung and silent workers."""
        self._watchdog.check_workers()

    def batch_timeout_s(self) -> float:
        return self._watchdog.batch_timeout_s()

    def busy_ratio(self) -> float:
        return self._delivery.busy_ratio()

    # ---- workers ------------------------------------------------------------------------------------
    def add_worker(self, worker: WorkerConnection) -> None:
        self._membership.add(worker)
        self._cold.served()

    def fail_cold(self, exc: ServingError) -> None:
        """The waker gave up (e.g. a failed load): with no worker in service, every held request gets
        `exc` now (with one, nothing: the queue is being served)."""
        if self.ready_workers == 0:
            self._delivery.fail_waiting(exc)
            self._cold.failed()

    def drain_worker(self, worker: WorkerConnection) -> None:
        """No new batches; the worker finishes what it holds, then exits (and is replaced)."""
        self._membership.drain(worker)

    def on_worker_lost(self, worker: WorkerConnection, reason: str) -> None:
        """The connection broke or the process exited: the batch it was running is recovered (retry,
        isolate or fail), a batch staged behind it goes back to the head of the queue untouched."""
        batches = self._membership.lose(worker, reason)
        self._delivery.recover_lost(worker, batches, reason)

    def on_message(self, worker: WorkerConnection, msg: p.Message) -> None:
        if isinstance(msg, p.BatchDone):
            self.on_batch_done(worker, msg)
        elif isinstance(msg, p.Credit):  # the hub counted the slots: the dispatcher may use them
            self._state.wake.set()
        else:
            what = type(msg).__name__
            log.warning("worker %s of model %s sent %s, which a batch model does not expect; ignored", worker.worker_id, self.name, what)

    def on_batch_done(self, worker: WorkerConnection, msg: p.BatchDone) -> None:
        self._delivery.on_batch_done(worker, msg)

    def ejection_status(self, worker: WorkerConnection) -> EjectionRecord:
        """The worker's outlier-ejection record (state, times ejected, until when), for the admin API."""
        return self._routing.ejection(worker.worker_id)

    # ---- snapshots -----------------------------------------------------------------------------------
    def statistics(self) -> RuntimeStatistics:
        state = self._state
        return RuntimeStatistics(
            name=self.name,
            version=self.version,
            kind=self.kind,
            ready=self.ready,
            workers=tuple(self._worker_snapshot(w) for w in state.workers),
            ready_workers=state.ready_workers(),
            queued=len(state.queue) + state.isolated_items(),
            # owned: a hedged item counts once, in the batch that answers for it now
            in_flight=sum(len(owned(b)) for w in state.workers for b in w.inflight.values()),
            detail=self._batch_statistics(),
            locality=self._routing.zones(state.workers),
        )

    def _batch_statistics(self) -> BatchStatistics:
        queue, estimator = self.queue, self.estimator
        return BatchStatistics(
            stalled=self.stalled(),
            queued_items=len(queue),
            queued_interactive=queue.live_in(INTERACTIVE),
            queued_bulk=queue.live_in(BULK),
            queue_capacity=queue.max_size,
            isolation_batches=len(self.isolation),
            isolated_items=self._state.isolated_items(),
            inflight_batches=sum(len(w.inflight) for w in self.workers),
            batch_timeout_s=self.batch_timeout_s(),
            busy_ratio=self.busy_ratio(),
            balancer=self.balancer.statistics(),
            ejection=self.ejector.statistics(),
            enqueued_total=self.enqueued_total,
            batch_latency_s=estimator.batch_latency_s,
            items_per_batch=estimator.items_per_batch,
            full_batch_latency_s=estimator.full_batch_latency_s(),
            loop_lag_s=self.loop_lag_s,
            max_batch_size=self.config.max_batch_size,
            cold_for_s=self._cold.held_for_s(),
        )

    def _worker_snapshot(self, w: WorkerConnection) -> WorkerSnapshot:
        detail = BatchWorkerDetail.of(w, self.balancer.latency_s(w.worker_id), self.ejection_status(w))
        return WorkerSnapshot.of(w, len(w.inflight), detail)
