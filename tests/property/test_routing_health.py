"""The routing vocabulary every policy shares (routing.health, routing.backoff) on a fake clock.

Backoff: starts at its initial wait, grows by its factor, never passes its cap, never shrinks as failures
add up. Ejection: worker ejection and upstream ejection last the same capped exponential schedule, and a
target ejected again while probing is out for longer even if it had earlier been forgiven.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.kinds.upstream.pool import Outcome, UpstreamPool
from inferd.routing import Backoff, Health, HealthChange, OutlierEjector

FAST_S, SLOW_S = 0.02, 0.2


@settings(max_examples=200, deadline=None)
@given(
    initial=st.floats(0.001, 10.0),
    ratio=st.floats(1.0, 1000.0),
    factor=st.floats(1.0, 4.0),
    step=st.integers(-3, 10_000),
)
def test_backoff_grows_by_its_factor_up_to_its_cap(
    initial: float, ratio: float, factor: float, step: int
) -> None:
    backoff = Backoff(initial, initial * ratio, factor)
    delay = backoff.delay_s(step)
    assert initial <= delay <= backoff.max_s
    assert backoff.delay_s(step + 1) >= delay
    if step <= 0:
        assert delay == initial
    elif delay < backoff.max_s:
        assert delay == pytest.approx(initial * factor**step)


def test_backoff_doubles_by_default_and_rejects_impossible_bounds() -> None:
    assert [Backoff(0.1, 30.0).delay_s(n) for n in range(10)][:4] == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert Backoff(0.1, 30.0).delay_s(9) == 30.0
    for bad in [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)]:
        with pytest.raises(ValueError, match="initial_s <= max_s"):
            Backoff(*bad)
    with pytest.raises(ValueError, match="factor"):
        Backoff(1.0, 2.0, factor=0.5)


def slow_fleet(clock: FakeClock) -> OutlierEjector:
    ej = OutlierEjector(clock, min_samples=2, base_ejection_s=1.0, max_ejection_s=4.0)
    for w in ("w0", "w1", "w2", "w3"):
        ej.add(w)
    for _ in range(2):
        for w in ("w0", "w1", "w2"):
            ej.observe(w, FAST_S)
    return ej


def test_worker_and_upstream_ejections_follow_one_schedule() -> None:
    clock = FakeClock()
    ej = slow_fleet(clock)
    pool = UpstreamPool(["http://u0/v1", "http://u1/v1"], clock, base_ejection_s=1.0, max_ejection_s=4.0)
    worker, upstream = [], []
    change = ej.overdue("w3", SLOW_S)
    for _ in range(4):
        assert change is not None and change.health is Health.EJECTED
        worker.append(change.ejected_for_s)
        clock.advance(change.ejected_for_s)
        assert ej.health("w3") is Health.PROBING
        change = ej.observe("w3", SLOW_S)  # the probe is slow again
    for _ in range(4):
        up = pool.probed("http://u0/v1", False, "refused")  # probing: one failure ejects
        assert up is not None and up.kind == "upstream" and up.health is Health.EJECTED
        upstream.append(up.ejected_for_s)
        clock.advance(up.ejected_for_s)
    assert worker == upstream == [1.0, 2.0, 4.0, 4.0]


def test_a_forgiven_worker_ejected_again_while_probing_is_out_for_longer() -> None:
    clock = FakeClock()
    ej = slow_fleet(clock)
    first = ej.overdue("w3", SLOW_S)
    clock.advance(first.ejected_for_s if first else 0.0)
    back = ej.observe("w3", FAST_S)
    assert back is not None and back.health is Health.READY and str(back).startswith("worker w3 is ready")
    clock.advance(10.0)  # in service longer than the longest ejection: its history is forgiven
    for _ in range(2):
        for w in ("w0", "w1", "w2"):
            ej.observe(w, FAST_S)
    again = ej.overdue("w3", SLOW_S)
    assert again is not None and again.ejected_for_s == 1.0
    clock.advance(1.0)
    longer = ej.observe("w3", SLOW_S)  # its probe is slow: the forgiveness is spent, out for longer
    assert longer is not None and longer.ejected_for_s == 2.0
    assert ej.status("w3").times_ejected == 2


def test_changes_and_records_speak_one_vocabulary() -> None:
    clock = FakeClock()
    pool = UpstreamPool(["http://u0/v1"], clock, consecutive_failures=1)
    assert pool.health("http://u0/v1") is Health.PROBING and pool.can_take()
    up = pool.probed("http://u0/v1", True)
    assert up == HealthChange("upstream", "http://u0/v1", Health.READY, "a probe answered")
    pool.acquire()
    out = pool.release("http://u0/v1", Outcome.FAILURE)
    assert (
        str(out) == "upstream http://u0/v1 ejected for 5.0s: 1 failures in a row, the last: a request failure"
    )
    (status,) = pool.statistics().upstreams
    assert status.health is status.ejection.health is Health.EJECTED
    assert status.ejection.ejected_until == clock.now() + 5.0 and status.ejection.times_ejected == 1
    ej = slow_fleet(clock)
    assert ej.status("w3").health is Health.READY and ej.status("w3").target == "w3"
    assert Health.READY > Health.PROBING > Health.EJECTED > Health.DRAINING > Health.DEAD
    assert Health.ROUTABLE == {Health.READY, Health.PROBING}
