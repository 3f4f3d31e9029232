"""Cold admission (kinds/batch/cold.py) under the recovery state machine's interleavings: the real
ModelRuntime with a waker starts with no worker; requests arrive while none is in service (held, or
refused at once), workers start when woken and leave again (back to zero), the waker gives up
(`fail_cold`), deadlines pass, callers cancel, batches complete, crash and hang.

Invariants, beside the recovery machine's (every request ends once, with its own result; nothing in two
places): an admission with no worker in service never takes the queue past the cold bound; a refusal is
a 429 (bound or deadline), never a 503; while requests are held with no worker, the waker was told.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inferd.clock import FakeClock
from inferd.errors import DeadlineExceeded, ModelError, Overloaded, WorkerDied, WorkerUnavailable
from inferd.kinds.batch.dispatcher import ItemResult, ModelRuntime
from inferd.kinds.batch.queue import QueuedItem
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.runtime.waking import SCALE_FROM_ZERO, Wakers
from tests.property.test_recovery_state_machine import RecoveryMachine

COLD_BOUND = 12


@dataclass
class Waker:
    eta: float | None = None
    wakes: int = 0
    waiting: list[int] = field(default_factory=list)

    def wakeable(self, model: str, version: int) -> str | None:
        return None

    def wake(self, model: str, version: int, waiting: int, oldest_age_s: float) -> None:
        self.wakes += 1
        self.waiting.append(waiting)

    def eta_s(self, model: str, version: int) -> float | None:
        return self.eta


class ColdMachine(RecoveryMachine):
    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.budget = RetryBudget(self.clock, ratio=0.2, min_per_s=1.0, window_s=10.0)
        self.max_batch = 8
        self.waker = Waker()
        wakers = Wakers()
        wakers.set("sim", self.waker, SCALE_FROM_ZERO)
        cfg = sim_config(
            max_batch_size=self.max_batch, max_wait_ms=5.0, max_queue_size=64, cold_queue_size=COLD_BOUND
        )
        self.rt = ModelRuntime(
            cfg, self.clock, Metrics().for_model("sim"), self.budget, kill_worker=lambda w: None, wakers=wakers
        )
        self.requests: list[QueuedItem] = []
        self.ended: dict[int, int] = {}
        self.next_worker = 0
        self.wakes_seen = 0

    @rule(n=st.integers(1, 6), deadline_ms=st.one_of(st.none(), st.integers(5, 400)))
    def arrive(self, n: int, deadline_ms: int | None) -> None:
        deadline = None if deadline_ms is None else self.clock.now() + deadline_ms / 1000
        cold, queued = self.rt.ready_workers == 0, len(self.rt.queue)
        start = len(self.requests)
        payloads = [f"req-{start + i}".encode() for i in range(n)]
        try:
            items = self._in_loop(lambda: self.rt.enqueue(payloads, deadline))
        except Overloaded as exc:  # refused at admission: never queued, answered at once with 429
            assert exc.reason in ("deadline", "queue_full")
            if cold and exc.reason == "queue_full":
                assert queued + n > COLD_BOUND or queued + n > self.rt.capacity(0)
            return
        if cold:
            assert len(self.rt.queue) <= COLD_BOUND, "an admission with no worker passed the cold bound"
            assert self.waker.wakes > self.wakes_seen, "held requests, and the waker was not told"
            self.wakes_seen = self.waker.wakes
        self.requests.extend(items)

    @precondition(lambda self: self.waker.wakes and len(self.rt.workers) < 2)
    @rule()
    def start_worker(self) -> None:
        """The waker's worker is in service."""
        self._in_loop(self._add_worker)

    @precondition(lambda self: self.rt.workers)
    @rule(pick=st.integers(0, 7))
    def leave(self, pick: int) -> None:
        """A worker lost and not replaced (scaled down, evicted): perhaps back to zero."""
        w = self.rt.workers[pick % len(self.rt.workers)]
        self._in_loop(lambda: self.rt.on_worker_lost(w, "gone (test)"))

    @rule()
    def give_up(self) -> None:
        """The waker gave up: with no worker in service the held requests get its 503."""
        cold = self.rt.ready_workers == 0
        queued = [i for i in self.rt.queue.live_items()]
        self._in_loop(lambda: self.rt.fail_cold(WorkerUnavailable("the test's waker gave up")))
        if cold:
            assert len(self.rt.queue) == 0 and all(i.reply.done() for i in queued)

    @rule(eta_ms=st.one_of(st.none(), st.integers(1, 500)))
    def measure(self, eta_ms: int | None) -> None:
        self.waker.eta = None if eta_ms is None else eta_ms / 1000

    @invariant()
    def results_are_own_and_final(self) -> None:
        for index, item in enumerate(self.requests):
            if not item.reply.done() or item.reply.cancelled():
                continue
            exc = item.reply.exception()
            if exc is None:
                result: ItemResult = item.reply.result()
                assert result.outputs["OUTPUT0"] == item.payload
            else:
                assert isinstance(exc, (ModelError, WorkerDied, DeadlineExceeded, WorkerUnavailable)), exc
            self.ended[index] = 1


ColdMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestColdAdmission = ColdMachine.TestCase
