"""The real ModelRuntime's retry, isolation and failover on a virtual clock, under arbitrary
interleavings of arrivals, batch completions, model errors, crashes, hangs, cancellations and
deadlines (hypothesis RuleBasedStateMachine). Fake workers stand in for the processes and sockets.

Invariants: every request ends exactly once (result, error, cancellation or expiry); a result is
always the request's own; the retry budget is never overdrawn; no item is in two places at once;
no batch exceeds the maximum.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inferd.clock import FakeClock
from inferd.errors import DeadlineExceeded, ModelError, Overloaded, WorkerDied
from inferd.kinds.batch.dispatcher import ItemResult, ModelRuntime
from inferd.kinds.batch.queue import ItemState, QueuedItem
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection
from tests.fakes.worker import FakeWriter


class RecoveryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.budget = RetryBudget(self.clock, ratio=0.2, min_per_s=1.0, window_s=10.0)
        self.max_batch = 8
        cfg = sim_config(max_batch_size=self.max_batch, max_wait_ms=5.0, max_queue_size=64, idempotent=True)
        self.rt = ModelRuntime(
            cfg, self.clock, Metrics().for_model("sim"), self.budget, kill_worker=lambda w: None
        )
        self.requests: list[QueuedItem] = []
        self.ended: dict[int, int] = {}
        self.next_worker = 0
        for _ in range(2):
            self._add_worker()

    def teardown(self) -> None:
        self.loop.close()

    # ---- helpers -----------------------------------------------------------------------------------
    def _in_loop(self, fn: Any) -> Any:
        async def call() -> Any:
            return fn()

        return self.loop.run_until_complete(call())

    def _add_worker(self) -> None:
        w = WorkerConnection(f"w{self.next_worker}", "sim", 1000 + self.next_worker, "h", FakeWriter())  # type: ignore[arg-type]
        w.version = 1
        self.next_worker += 1
        self.rt.add_worker(w)

    def running_workers(self) -> list[WorkerConnection]:
        return [w for w in self.rt.workers if w.inflight]

    # ---- rules -------------------------------------------------------------------------------------
    @rule(n=st.integers(1, 6), deadline_ms=st.one_of(st.none(), st.integers(5, 400)))
    def arrive(self, n: int, deadline_ms: int | None) -> None:
        deadline = None if deadline_ms is None else self.clock.now() + deadline_ms / 1000
        if len(self.rt.queue) + n > self.rt.queue.max_size or not self.rt.ready_workers:
            return
        start = len(self.requests)
        payloads = [f"req-{start + i}".encode() for i in range(n)]
        try:
            items = self._in_loop(lambda: self.rt.enqueue(payloads, deadline))
        except Overloaded as exc:  # refused at admission: never queued, answered at once with 429
            assert exc.reason in ("deadline", "queue_full")
            return
        self.requests.extend(items)

    @rule()
    def solo(self) -> None:
        """One request alone past max_wait: it runs as a batch of one."""
        self.arrive(1, None)
        self.advance(6)
        self.dispatch()

    @rule()
    def dispatch(self) -> None:
        self._in_loop(self.rt.dispatch_due)
        for w in self.rt.workers:
            for batch in w.inflight.values():
                assert 1 <= len(batch.items) <= self.max_batch

    @rule(ms=st.integers(1, 60))
    def advance(self, ms: int) -> None:
        self.clock.advance_ms(ms)
        now = self.clock.now()
        late = [
            i for i in self.requests if not i.reply.done() and i.deadline is not None and i.deadline <= now
        ]
        if late:  # what the HTTP layer's per-request timer does
            self._in_loop(lambda: self.rt.expire(late))

    @precondition(lambda self: self.running_workers())
    @rule(pick=st.integers(0, 7), outcome=st.sampled_from(["ok", "ok", "ok", "model_error"]))
    def complete(self, pick: int, outcome: str) -> None:
        w = self.running_workers()[pick % len(self.running_workers())]
        batch = next(iter(w.inflight.values()))
        if outcome == "model_error" and any(i.payload.endswith(b"3") for i in batch.items):
            msg = p.BatchDone(batch.batch_id, 0.01, batch_error=("ModelError", "fails on inputs ending in 3"))
        else:
            outs = [{"OUTPUT0": i.payload} for i in batch.items]
            msg = p.BatchDone(batch.batch_id, 0.01, outputs=outs)
        self._in_loop(lambda: self.rt.on_batch_done(w, msg))

    @precondition(lambda self: self.rt.workers)
    @rule(pick=st.integers(0, 7), hang=st.booleans(), busy=st.booleans())
    def crash(self, pick: int, hang: bool, busy: bool = True) -> None:
        pool = self.running_workers() if busy and self.running_workers() else self.rt.workers
        w = pool[pick % len(pool)]
        if hang:
            w.failure = "hung (test)"
        self._in_loop(lambda: self.rt.on_worker_lost(w, "killed by the test"))
        self._add_worker()  # the supervisor's replacement

    @precondition(lambda self: self.running_workers())
    @rule(ms=st.integers(100, 3000))
    def slow(self, ms: int) -> None:
        """Time passes with batches still running, after the fleet's batches took ~10-18 ms: the
        watchdog hedges the overdue ones to other workers (or flags a worker as hung; the test's `crash`
        rule plays the kill)."""
        for size in (1, 2, 4, 8):
            self.rt.estimator.observe_batch(size, 0.010 + 0.001 * size)
        for w in self.rt.workers:
            for _ in range(3):
                self.rt.ejector.observe(w.worker_id, 0.012)
        self.advance(ms)
        self._in_loop(self.rt.check_workers)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 10_000))
    def cancel(self, pick: int) -> None:
        item = self.requests[pick % len(self.requests)]
        self._in_loop(lambda: self.rt.withdraw([item]))

    # ---- invariants --------------------------------------------------------------------------------
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
                assert isinstance(exc, (ModelError, WorkerDied, DeadlineExceeded)), exc
            assert item.state in ItemState.TERMINAL or item.state is ItemState.RUNNING or item.reply.done()
            self.ended[index] = 1

    @invariant()
    def budget_never_overdrawn(self) -> None:
        assert self.budget.statistics().balance >= 0

    @invariant()
    def no_item_in_two_places(self) -> None:
        """Owned places only: a hedged item also sits in its slow original batch, which no longer
        answers for it (its batch_id moved on)."""
        seen: set[int] = set()
        places = [self.rt.queue.live_items()]
        places += [list(g) for g in self.rt.isolation]
        places += [
            [i for i in b.items if i.batch_id == b.batch_id]
            for w in self.rt.workers
            for b in w.inflight.values()
        ]
        for place in places:
            for item in place:
                if item.reply.done():
                    continue
                assert id(item) not in seen, "an item is waiting in two places"
                seen.add(id(item))

    @invariant()
    def queue_count_matches_its_items(self) -> None:
        assert len(self.rt.queue) == len(self.rt.queue.live_items())

    @invariant()
    def every_unfinished_request_is_somewhere(self) -> None:
        waiting = {id(i) for w in self.rt.workers for b in w.inflight.values() for i in b.items}
        waiting |= {id(i) for g in self.rt.isolation for i in g}
        for item in self.requests:
            if item.reply.done():
                continue
            assert item.state is ItemState.QUEUED or id(item) in waiting, (item.state, item.payload)


RecoveryMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestRecovery = RecoveryMachine.TestCase


def test_drained_machine_answers_everyone_exactly_once() -> None:
    """Run a fixed scenario to the end: every request must end, once."""
    m = RecoveryMachine()
    try:
        for _ in range(5):
            m.arrive(6, None)
        for step in range(300):
            m.dispatch()
            if m.running_workers():
                if step % 7 == 3:
                    m.crash(step, hang=step % 2 == 0)
                else:
                    m.complete(step, "model_error" if step % 5 == 0 else "ok")
            m.advance(10)
        assert all(i.reply.done() for i in m.requests)
        outcomes = [
            ("ok" if i.reply.exception() is None else type(i.reply.exception()).__name__) for i in m.requests
        ]
        assert outcomes.count("ok") >= 20
        for item, outcome in zip(m.requests, outcomes, strict=True):
            if outcome == "ModelError":
                assert item.payload.endswith(b"3"), item.payload
    finally:
        m.teardown()


def test_isolation_batches_are_not_starved_by_a_busy_worker() -> None:
    """Under steady load a worker is never idle (a full batch is always staged behind the running one):
    the halves of a crashed batch must still get the next free slot, ahead of new work."""
    m = RecoveryMachine()
    try:
        for _ in range(6):
            m.arrive(8, None)
        m.dispatch()  # both workers: one running + one staged full batch each
        victim = m.rt.workers[0]
        crashed = [i.payload for i in next(iter(victim.inflight.values())).items]
        m.crash(0, hang=False, busy=True)
        m.rt.drain_worker(m.rt.workers[-1])  # the replacement takes no work: only the busy survivor is left
        for _ in range(4):  # keep the survivor saturated; complete one batch at a time
            m.arrive(8, None)
            m.complete(0, "ok")
            m.dispatch()
        done = {i.payload for i in m.requests if i.reply.done() and i.reply.exception() is None}
        assert done & set(crashed), "no half of the crashed batch ran while the worker stayed busy"
    finally:
        m.teardown()
