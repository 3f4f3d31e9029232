"""The openai-upstream balancer policy (routing.upstreams.UpstreamPool) on a fake clock.

Invariants: a request only goes to a routable upstream not excluded, with a free slot, the healthiest and
then the least loaded of those; 503 exactly when nothing is routable, 429 exactly when everything
routable is full; in-flight counts match what callers hold; a READY upstream never exceeds its cap and a
PROBING one never takes a second trial; an ejected upstream takes nothing until its time is over, then
is probed back. Behaviour: load spreads evenly; ejections grow and are capped.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inferd.clock import FakeClock
from inferd.errors import Overloaded, WorkerUnavailable
from inferd.kinds.upstream.pool import Outcome, UpstreamPool, UpstreamStatus
from inferd.routing.health import Health

URLS = [f"http://u{i}:8000/v1" for i in range(4)]
CAP = 3


def statuses(pool: UpstreamPool) -> dict[str, UpstreamStatus]:
    return {s.upstream: s for s in pool.statistics().upstreams}


def cap_of(s: UpstreamStatus) -> int:
    return CAP if s.health is Health.READY else 1


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.pool = UpstreamPool(
            URLS,
            self.clock,
            max_inflight=CAP,
            consecutive_failures=2,
            base_ejection_s=1.0,
            max_ejection_s=3.0,
        )
        self.held: list[str] = []
        self.trials: dict[str, int] = {}
        """Requests taken by each upstream while it was PROBING and not released yet."""

    @rule(exclude=st.sets(st.sampled_from(URLS), max_size=3))
    def acquire(self, exclude: set[str]) -> None:
        before = statuses(self.pool)
        routable = [s for u, s in before.items() if u not in exclude and s.health in Health.ROUTABLE]
        free = [s for s in routable if s.inflight < cap_of(s)]
        try:
            chosen = self.pool.acquire(exclude)
        except WorkerUnavailable:
            assert not routable
            return
        except Overloaded as exc:
            assert routable and not free
            assert exc.retry_after_s >= 0
            return
        s = before[chosen]
        assert s in free
        best = max(f.health for f in free)
        assert s.health == best
        assert s.inflight == min(f.inflight for f in free if f.health == best)
        self.held.append(chosen)
        if s.health is Health.PROBING:
            self.trials[chosen] = self.trials.get(chosen, 0) + 1

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100), outcome=st.sampled_from(list(Outcome)))
    def release(self, index: int, outcome: Outcome) -> None:
        url = self.held.pop(index % len(self.held))
        if self.trials.get(url):
            self.trials[url] -= 1
        before = self.pool.health(url)
        change = self.pool.release(url, outcome)
        self._check_change(url, before, outcome, change)

    @rule(url=st.sampled_from(URLS), ok=st.booleans())
    def probe(self, url: str, ok: bool) -> None:
        before = self.pool.health(url)
        change = self.pool.probed(url, ok, "" if ok else "connection refused")
        self._check_change(url, before, Outcome.SUCCESS if ok else Outcome.FAILURE, change)

    @rule(seconds=st.floats(0.0, 2.0))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def _check_change(self, url: str, before: Health, outcome: Outcome, change: object) -> None:
        after = self.pool.health(url)
        if before is Health.EJECTED or outcome is Outcome.IGNORABLE:
            assert change is None and after is before, (
                "an ejected upstream or an ignorable outcome moved health"
            )
        if before is Health.PROBING and outcome is not Outcome.IGNORABLE:
            expected = Health.READY if outcome is Outcome.SUCCESS else Health.EJECTED
            assert after is expected, "the outcome of a probing upstream did not decide its health"
        if change is not None:
            assert after is change.health  # type: ignore[attr-defined]
            if after is Health.EJECTED:
                assert 1.0 <= change.ejected_for_s <= 3.0  # type: ignore[attr-defined]
                self.trials.pop(url, None)  # trials before an ejection are not the next probe's

    @invariant()
    def inflight_matches_what_callers_hold(self) -> None:
        for url, s in statuses(self.pool).items():
            assert s.inflight == self.held.count(url)

    @invariant()
    def caps_hold(self) -> None:
        for url, s in statuses(self.pool).items():
            if s.health is Health.READY:
                assert s.inflight <= CAP
            if s.health is Health.PROBING:
                assert self.trials.get(url, 0) <= 1, "a probing upstream took a second trial request"

    @invariant()
    def ejections_end_on_time(self) -> None:
        now = self.clock.now()
        for s in statuses(self.pool).values():
            if s.health is Health.EJECTED:
                assert s.ejection.ejected_until is not None and now < s.ejection.ejected_until <= now + 3.0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def up_pool(n: int, clock: FakeClock, cap: int = CAP) -> UpstreamPool:
    pool = UpstreamPool(URLS[:n], clock, max_inflight=cap, consecutive_failures=2)
    for url in URLS[:n]:
        pool.probed(url, True)
    return pool


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.data())
def test_least_in_flight_spreads_requests_evenly(n: int, data: st.DataObject) -> None:
    pool = up_pool(n, FakeClock())
    for _ in range(data.draw(st.integers(0, n * CAP))):
        pool.acquire()
    loads = [s.inflight for s in pool.statistics().upstreams]
    assert max(loads) - min(loads) <= 1


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4))
def test_every_upstream_full_is_a_429_and_none_healthy_is_a_503(n: int) -> None:
    clock = FakeClock()
    pool = up_pool(n, clock, cap=1)
    for _ in range(n):
        pool.acquire()
    try:
        pool.acquire()
        raise AssertionError("a full pool accepted a request")
    except Overloaded as exc:
        assert exc.retry_after_s == 1.0
    for url in URLS[:n]:
        pool.release(url, Outcome.FAILURE)
        pool.probed(url, False, "connection refused")
    try:
        pool.acquire()
        raise AssertionError("a pool of ejected upstreams accepted a request")
    except WorkerUnavailable as exc:
        assert all(url in exc.message for url in URLS[:n])
        assert exc.retry_after_s >= 1.0


def test_ejection_grows_is_capped_and_is_probed_back() -> None:
    clock = FakeClock()
    pool = UpstreamPool(URLS[:2], clock, consecutive_failures=2, base_ejection_s=5.0, max_ejection_s=12.0)
    url = URLS[0]
    pool.probed(url, True)
    lengths = []
    for _ in range(4):
        change = pool.probed(url, False, "refused") or pool.probed(url, False, "refused")
        assert change is not None and change.health is Health.EJECTED
        lengths.append(change.ejected_for_s)
        assert pool.acquire() == URLS[1]  # never the ejected one
        pool.release(URLS[1], Outcome.SUCCESS)
        clock.advance(change.ejected_for_s)
        assert pool.health(url) is Health.PROBING
        if len(lengths) < 4:
            assert pool.probed(url, True) is not None and pool.health(url) is Health.READY
        else:
            break
    assert lengths == [5.0, 10.0, 12.0, 12.0]


def test_answering_probes_do_not_hide_failing_requests() -> None:
    clock = FakeClock()
    pool = UpstreamPool(URLS[:2], clock, consecutive_failures=3)
    bad = URLS[0]
    pool.probed(bad, True)
    changes = []
    for _ in range(3):
        taken = pool.acquire(exclude=[URLS[1]])
        assert taken == bad
        changes.append(pool.release(bad, Outcome.FAILURE))
        pool.probed(bad, True)  # GET /v1/models still answers
    assert changes[-1] is not None and changes[-1].health is Health.EJECTED
