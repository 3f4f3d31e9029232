"""Routing policies on a virtual clock: the p2c balancer, outlier ejection, and both wired into the real
ModelRuntime (fake workers, as in test_recovery_state_machine.py).

Invariants: a batch never goes to a dead, draining or ejected worker while another may take it; no worker
ever holds more than MAX_INFLIGHT batches; ejected (and probing) workers never exceed the ejection share and
never include the last in-service worker; an ejected worker is probed after its ejection time. Behaviour
(RELIABILITY F3): a worker 10x slower than the rest gets far less than its fair share within seconds.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inferd.clock import FakeClock
from inferd.errors import Overloaded
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing import Candidate, Health, OutlierEjector, P2CBalancer
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from inferd.wire.connection import MAX_INFLIGHT, WorkerConnection, WorkerState
from tests.property.test_recovery_state_machine import FakeWriter

FAST_S, SLOW_S = 0.02, 0.2

# ---- the balancer alone ----------------------------------------------------------------------------------

candidates = st.lists(
    st.tuples(
        st.sampled_from(list(Health)), st.integers(0, MAX_INFLIGHT + 1), st.none() | st.floats(0.001, 1.0)
    ),
    min_size=0,
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(candidates, st.integers(0, 2**32 - 1))
def test_balancer_only_chooses_routable_workers_under_the_cap(specs: list[Any], seed: int) -> None:
    balancer = P2CBalancer(MAX_INFLIGHT)
    pool = []
    for index, (health, inflight, latency) in enumerate(specs):
        pool.append(Candidate(f"w{index}", health, inflight))
        if latency is not None:
            balancer.observe(f"w{index}", latency)
    eligible = [c for c in pool if c.health in Health.ROUTABLE and c.inflight < MAX_INFLIGHT]
    choice = balancer.choose(pool, random.Random(seed))
    if not eligible:
        assert choice is None
        assert balancer.statistics().no_candidate == 1
        return
    assert choice in eligible
    if len(eligible) == 2:  # the pair is the whole pool: the choice must be its better half
        other = eligible[1] if choice is eligible[0] else eligible[0]
        assert choice.health >= other.health
        if choice.health == other.health:
            assert balancer.expected_s(choice) <= balancer.expected_s(other)


def test_balancer_prefers_the_worker_that_finishes_sooner_and_counts_equal_loads() -> None:
    balancer = P2CBalancer(MAX_INFLIGHT)
    rng = random.Random(1)
    fresh = [Candidate("a", Health.READY, 0), Candidate("b", Health.READY, 0)]
    balancer.choose(fresh, rng)  # nothing known: both at the prior
    assert balancer.statistics().equal_loads == 1
    balancer.observe("a", 0.010)
    balancer.observe("b", 0.100)
    assert all(balancer.choose(fresh, rng).worker_id == "a" for _ in range(20))  # type: ignore[union-attr]
    # a busy fast worker (2 x 10 ms) still beats an idle slow one (100 ms); health beats both
    busy = [Candidate("a", Health.READY, 1), Candidate("b", Health.READY, 0)]
    assert balancer.choose(busy, rng).worker_id == "a"  # type: ignore[union-attr]
    probing = [Candidate("a", Health.PROBING, 0), Candidate("b", Health.READY, 0)]
    assert balancer.choose(probing, rng).worker_id == "b"  # type: ignore[union-attr]
    stats = balancer.statistics()
    assert stats.choices == 23 and stats.pairs == 23 and stats.health_decided == 1 and stats.equal_loads == 1


# ---- the ejector alone ---------------------------------------------------------------------------------------


def ejector(clock: FakeClock, **kw: Any) -> OutlierEjector:
    kw = {"min_samples": 2, "base_ejection_s": 1.0, "max_ejection_s": 4.0, **kw}
    return OutlierEjector(clock, **kw)


def test_ejected_worker_is_probed_back_in_after_its_ejection_time() -> None:
    clock = FakeClock()
    ej = ejector(clock)
    for w in ("w0", "w1", "w2", "w3"):
        ej.add(w)
    for _ in range(2):
        for w in ("w0", "w1", "w2"):
            assert ej.observe(w, FAST_S) is None
        change = ej.observe("w3", SLOW_S)
    assert change is not None and change.health is Health.EJECTED and change.ejected_for_s == 1.0
    clock.advance(0.999)
    assert ej.health("w3") is Health.EJECTED
    clock.advance(0.001)
    assert ej.health("w3") is Health.PROBING
    again = ej.observe("w3", SLOW_S)  # the probe is slow again: out for twice as long
    assert again is not None and again.health is Health.EJECTED and again.ejected_for_s == 2.0
    clock.advance(2.0)
    back = ej.observe("w3", FAST_S)
    assert back is not None and back.health is Health.READY
    assert ej.status("w3").times_ejected == 2 and ej.statistics().returned_total == 1


def test_an_overdue_batch_ejects_at_once_and_a_reconnect_keeps_the_ejection() -> None:
    clock = FakeClock()
    ej = ejector(clock)
    for w in ("w0", "w1", "w2", "w3"):
        ej.add(w)
    for _ in range(3):
        for w in ("w0", "w1", "w2"):
            ej.observe(w, FAST_S)
    assert ej.overdue("w3", 2 * FAST_S) is None  # running longer than usual is not yet slow
    change = ej.overdue("w3", SLOW_S)  # still running, far past the fleet: out now, no samples needed
    assert change is not None and change.health is Health.EJECTED
    ej.remove("w3")  # its connection broke ...
    ej.add("w3")  # ... and it registered again under the same id: still ejected
    assert ej.health("w3") is Health.EJECTED and ej.status("w3").times_ejected == 1
    clock.advance(ej.max_ejection_s + 1)
    ej.remove("w3")
    clock.advance(ej.max_ejection_s + 1)
    ej.add("w3")  # gone longer than the longest ejection: a clean record
    assert ej.health("w3") is Health.READY and ej.status("w3").times_ejected == 0


def test_consecutive_failures_eject_but_never_the_last_worker() -> None:
    clock = FakeClock()
    ej = ejector(clock, consecutive_failures=3)
    ej.add("solo")
    for _ in range(10):
        assert ej.failure("solo") is None  # a fleet of one never ejects
    ej.add("w1")
    for _ in range(3):
        ej.failure("w1")
    assert ej.health("w1") is Health.EJECTED  # a fleet of two may eject one
    for _ in range(10):
        ej.failure("solo")
    assert ej.health("solo") is Health.READY and ej.statistics().refused_by_share_total >= 1
    ej.remove("solo")  # the fleet shrank to one: the ejected worker comes back at once
    assert ej.health("w1") is Health.READY


class EjectionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.share = 0.3
        self.ej = ejector(self.clock, consecutive_failures=2, max_ejection_share=self.share)
        self.workers: list[str] = []
        self.next = 0

    @rule()
    def add(self) -> None:
        self.workers.append(f"w{self.next}")
        self.next += 1
        self.ej.add(self.workers[-1])

    @precondition(lambda self: self.workers)
    @rule(pick=st.integers(0, 20))
    def remove(self, pick: int) -> None:
        self.ej.remove(self.workers.pop(pick % len(self.workers)))

    @precondition(lambda self: self.workers)
    @rule(pick=st.integers(0, 20), slow=st.booleans(), fail=st.booleans())
    def batch(self, pick: int, slow: bool, fail: bool) -> None:
        w = self.workers[pick % len(self.workers)]
        if fail:
            self.ej.failure(w)
        else:
            self.ej.observe(w, SLOW_S if slow else FAST_S)

    @rule(ms=st.integers(1, 1500))
    def advance(self, ms: int) -> None:
        self.clock.advance_ms(ms)

    @invariant()
    def ejection_stays_within_its_share(self) -> None:
        stats = self.ej.statistics()
        n = len(self.workers)
        out = stats.ejected + stats.probing
        assert stats.workers == n
        assert out <= stats.max_ejected <= max(0, n - 1)
        assert stats.max_ejected <= max(1, math.floor(self.share * n))

    @invariant()
    def ejected_workers_come_back_after_their_time(self) -> None:
        now = self.clock.now()
        for w in self.workers:
            status = self.ej.status(w)
            if status.health is Health.EJECTED:
                assert status.ejected_until is not None
                assert now < status.ejected_until <= now + self.ej.max_ejection_s


EjectionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestEjection = EjectionMachine.TestCase


# ---- both wired into the real ModelRuntime -------------------------------------------------------------------


def add_worker(rt: ModelRuntime, index: int) -> WorkerConnection:
    w = WorkerConnection(f"w{index}", "sim", 1000 + index, "h", FakeWriter())  # type: ignore[arg-type]
    w.version = 1
    rt.add_worker(w)
    return w


class RoutingMachine(RuleBasedStateMachine):
    """Arrivals, completions (one worker 10x slower), model errors, drains, crashes and time, in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        cfg = sim_config(max_batch_size=4, max_wait_ms=5.0, max_queue_size=256, idempotent=True)
        self.rt = ModelRuntime(
            cfg,
            self.clock,
            Metrics().for_model("sim"),
            RetryBudget(self.clock, ratio=0.2, min_per_s=5.0),
            kill_worker=lambda w: None,
            ejector=ejector(self.clock, consecutive_failures=2, base_ejection_s=0.05, max_ejection_s=0.2),
            rng=random.Random(7),
        )
        self.next_worker = 0
        self.latency: dict[str, float] = {}
        for _ in range(4):
            self._add_worker()

    def teardown(self) -> None:
        self.loop.close()

    def _in_loop(self, fn: Any) -> Any:
        async def call() -> Any:
            return fn()

        return self.loop.run_until_complete(call())

    def _add_worker(self) -> None:
        w = add_worker(self.rt, self.next_worker)
        self.latency[w.worker_id] = SLOW_S if self.next_worker % 4 == 3 else FAST_S
        self.next_worker += 1

    def running(self) -> list[WorkerConnection]:
        return [w for w in self.rt.workers if w.inflight]

    @rule(n=st.integers(1, 8))
    def arrive(self, n: int) -> None:
        if len(self.rt.queue) + n > self.rt.queue.max_size or not self.rt.ready_workers:
            return
        try:
            self._in_loop(lambda: self.rt.enqueue([b"x"] * n, None))
        except Overloaded:
            pass

    @rule()
    def dispatch(self) -> None:
        before = {w.worker_id: set(w.inflight) for w in self.rt.workers}
        ready = [w for w in self.rt.workers if w.state is WorkerState.READY]
        state = {w.worker_id: self.rt.ejection_status(w).health for w in ready}
        in_service = [w for w in ready if state[w.worker_id] is not Health.EJECTED]
        self._in_loop(self.rt.dispatch_due)
        for w in self.rt.workers:
            new = set(w.inflight) - before[w.worker_id]
            if not new:
                continue
            assert w.state is WorkerState.READY, f"a batch went to {w.state.value} worker {w.worker_id}"
            assert state[w.worker_id] is not Health.EJECTED or not in_service, "sent to an ejected worker"
            if state[w.worker_id] is Health.PROBING:
                assert not before[w.worker_id] and len(new) == 1, "a probing worker got more than one batch"

    @precondition(lambda self: self.running())
    @rule(pick=st.integers(0, 7), fail=st.booleans())
    def complete(self, pick: int, fail: bool) -> None:
        w = self.running()[pick % len(self.running())]
        batch_id, batch = next(iter(w.inflight.items()))
        latency = self.latency[w.worker_id]
        if fail:
            msg = p.BatchDone(batch_id, latency, batch_error=("ModelError", "the device is unwell"))
        else:
            msg = p.BatchDone(batch_id, latency, outputs=[{"OUTPUT0": b"y"}] * len(batch.items))
        self._in_loop(lambda: self.rt.on_batch_done(w, msg))

    @precondition(lambda self: self.rt.workers)
    @rule(pick=st.integers(0, 7), crash=st.booleans())
    def leave(self, pick: int, crash: bool) -> None:
        w = self.rt.workers[pick % len(self.rt.workers)]
        if crash or w.state is not WorkerState.READY:
            self._in_loop(lambda: self.rt.on_worker_lost(w, "killed by the test"))
        else:
            self._in_loop(lambda: self.rt.drain_worker(w))
        self._add_worker()  # the supervisor's replacement

    @rule(ms=st.integers(1, 120))
    def advance(self, ms: int) -> None:
        self.clock.advance_ms(ms)

    @invariant()
    def no_worker_over_the_cap(self) -> None:
        for w in self.rt.workers:
            assert len(w.inflight) <= MAX_INFLIGHT

    @invariant()
    def ejection_stays_within_its_share(self) -> None:
        stats = self.rt.ejector.statistics()
        ready = sum(1 for w in self.rt.workers if w.state is WorkerState.READY)
        assert stats.workers == ready  # draining and lost workers left the ejector's fleet
        assert stats.ejected + stats.probing <= stats.max_ejected <= max(0, ready - 1)


RoutingMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestRouting = RoutingMachine.TestCase


async def run_fleet(
    latencies: list[float], items_per_s: float, seconds: float, warmup_s: float
) -> ModelRuntime:
    """Open-loop arrivals on a 1 ms tick; each worker answers its running batch after its latency. Returns
    the runtime; `batches_after_warmup` is stored on it for the test (batches dispatched per worker)."""
    clock = FakeClock()
    cfg = sim_config(max_batch_size=8, max_wait_ms=5.0, max_queue_size=100_000, idempotent=True)
    rt = ModelRuntime(cfg, clock, Metrics().for_model("sim"), RetryBudget(clock), lambda w: None)
    fleet = [(add_worker(rt, i), latency) for i, latency in enumerate(latencies)]
    counts = {w.worker_id: 0 for w, _ in fleet}
    seen: set[int] = set()
    start, owed = clock.now(), 0.0
    while clock.now() - start < seconds:
        clock.advance_ms(1)
        owed += items_per_s / 1000
        if owed >= 1:
            rt.enqueue([b"x"] * int(owed), None)
            owed -= int(owed)
        for w, latency in fleet:
            if w.inflight and clock.now() >= w.running_since + latency - 1e-9:
                batch_id, batch = next(iter(w.inflight.items()))
                rt.on_batch_done(
                    w, p.BatchDone(batch_id, latency, outputs=[{"OUTPUT0": b"y"}] * len(batch.items))
                )
        rt.dispatch_due()
        for w, _ in fleet:
            for batch_id in set(w.inflight) - seen:
                seen.add(batch_id)
                counts[w.worker_id] += clock.now() - start >= warmup_s
    rt.batches_after_warmup = counts  # type: ignore[attr-defined]
    return rt


async def test_slow_worker_gets_far_less_than_its_fair_share_at_high_load() -> None:
    """RELIABILITY F3 at 0.8 C: one worker of four 10x slower; from 2 s on, >= 80% of its fair share of
    batches goes elsewhere (here: p2c on expected completion alone does it; nothing needs ejecting)."""
    rt = await run_fleet([FAST_S, FAST_S, FAST_S, SLOW_S], items_per_s=1000, seconds=10, warmup_s=2)
    counts = rt.batches_after_warmup  # type: ignore[attr-defined]
    share = counts["w3"] / sum(counts.values())
    assert share <= 0.2 * 0.25, counts
    assert rt.balancer.statistics().pairs > 0


async def test_slow_worker_is_ejected_when_the_fast_ones_cannot_keep_it_idle() -> None:
    """Past what the fast workers can take, idle-first routing would feed the slow worker; the ejector
    takes it out, then probes it (one batch) when each ejection ends, and ejects it again for longer."""
    rt = await run_fleet([FAST_S, FAST_S, FAST_S, SLOW_S], items_per_s=1300, seconds=10, warmup_s=2)
    counts = rt.batches_after_warmup  # type: ignore[attr-defined]
    assert counts["w3"] / sum(counts.values()) <= 0.01, counts
    stats = rt.ejector.statistics()
    assert stats.ejections_total >= 2 and stats.ejected + stats.probing == 1
    status = rt.ejector.status("w3")
    assert status.times_ejected >= 2 and status.health is not Health.READY
    assert all(rt.ejector.health(f"w{i}") is Health.READY for i in range(3))
