"""The zone rule (routing/locality.py) under hypothesis: whatever the fleet does (workers joining, draining,
lost, healthy or not, time passing), the shares sum to 1 or are empty and only zones with a healthy worker
get any, and the choices stay within them; with the other zones healthy, the local share never exceeds the
rule's value, falls at once, and never rises before the hold nor faster than the failback ramp."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.routing.locality import Backlog, LocalityPolicy

ZONES = ("a", "b", "c")
FAILBACK_S, HOLD_S = 10.0, 5.0

fleet_events = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(("join", "leave", "lose")), st.sampled_from(ZONES), st.integers(0, 5)),
        st.tuples(st.just("wait"), st.floats(0.0, 8.0), st.just(0)),
        st.tuples(st.just("shares"), st.fixed_dictionaries({z: st.integers(0, 6) for z in ZONES}), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(fleet_events, st.floats(1.0, 3.0))
def test_shares_are_a_distribution_over_zones_with_a_healthy_worker(
    script: list[tuple[str, object, int]], overprovisioning: float
) -> None:
    clock = FakeClock()
    p = LocalityPolicy(clock, "a", overprovisioning=overprovisioning, failback_s=FAILBACK_S, hold_s=HOLD_S)
    for op, arg, i in script:
        if op == "wait":
            assert isinstance(arg, float)
            clock.advance(arg)
        elif op == "join":
            p.join(f"{arg}-{i}", str(arg))
        elif op in ("leave", "lose"):
            getattr(p, op)(f"{arg}-{i}")
        else:
            assert isinstance(arg, dict)
            shares = p.shares(arg)
            if shares.shares:
                assert math.fsum(shares.shares.values()) == pytest.approx(1.0)
            for zone, share in shares.shares.items():
                assert share > 0.0 and min(arg[zone], p.expected(zone)) > 0, (zone, shares)
            if any(min(n, p.expected(z)) > 0 for z, n in arg.items()):
                assert shares.shares, "a healthy worker, yet no zone has a share"
            if shares.shares:
                zone = p.choose(shares, set(ZONES)).zone
                assert zone in shares.shares
                p.served(zone)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.floats(0.0, 6.0)), max_size=40), st.floats(1.0, 2.0))
def test_the_local_share_falls_at_once_and_rises_only_after_the_hold_along_the_ramp(
    steps: list[tuple[int, float]], overprovisioning: float
) -> None:
    """Zone a has 10 workers, of which `healthy` are healthy at each step; zones b and c are healthy and
    large enough to take any spill (no normalization), so the local share is the failback's value."""
    clock = FakeClock()
    p = LocalityPolicy(clock, "a", overprovisioning=overprovisioning, failback_s=FAILBACK_S, hold_s=HOLD_S)
    for zone, n in (("a", 10), ("b", 20), ("c", 20)):
        for i in range(n):
            p.join(f"{zone}-{i}", zone)
    last_at, last, low_since = clock.now(), p.shares({"a": 10, "b": 20, "c": 20}).local_share, None
    for healthy, wait_s in steps:
        clock.advance(wait_s)
        now = clock.now()
        shares = p.shares({"a": healthy, "b": 20, "c": 20})
        local, rule = shares.local_share, shares.rule
        assert local <= rule + 1e-9
        if rule <= last:
            assert local == pytest.approx(rule)  # a fall (or no change) is taken at once
        if local > last + 1e-9:  # a rise: after the hold, at most 1 per failback_s since the hold ended
            assert low_since is not None
            assert local - last <= (now - max(last_at, low_since + HOLD_S)) / FAILBACK_S + 1e-9
        low_since = None if local >= rule - 1e-12 else (low_since if low_since is not None and local >= last - 1e-12 else now)
        last_at, last = now, local


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries({z: st.integers(0, 4) for z in ZONES}),
    st.fixed_dictionaries({z: st.integers(0, 4) for z in ZONES}),
    st.sets(st.sampled_from(ZONES)),
    st.integers(1, 200),
    st.floats(0.0, 1.0),
    st.one_of(st.none(), st.floats(0.001, 0.5)),
    st.one_of(st.none(), st.floats(-1.0, 30.0)),
)
def test_work_spills_only_from_short_zones_after_the_floor_to_an_idle_zone_in_service(
    healthy: dict[str, int],
    ejected: dict[str, int],
    free: set[str],
    queued: int,
    waited_s: float,
    batch_s: float | None,
    remaining_s: float | None,
) -> None:
    """Whatever the fleet and the backlog: a spill goes to a zone with no share, an idle worker and one in
    service, only while the zones with a share are short of capacity, and (unless none of theirs is in
    service) only after the floor; the zone chosen otherwise has a share."""
    p = LocalityPolicy(FakeClock(), "a")
    for z in ZONES:
        for i in range(4):
            p.join(f"{z}-{i}", z)
    serving = {z: max(0, n - ejected[z]) for z, n in healthy.items()}
    shares = p.shares(healthy, serving)
    backlog = Backlog(waited_s, 0.05, queued, bound=100, max_batch=8, batch_s=batch_s, remaining_s=remaining_s)
    choice = p.choose(shares, free, backlog)
    if choice.zone is None:
        return
    assert choice.zone in free
    if not choice.spilled:
        assert shares.of(choice.zone) > 0.0
        return
    assert shares.of(choice.zone) == 0.0 and shares.serving.get(choice.zone, 0) > 0
    assert p.short(shares, backlog)
    in_service = sum(n for z, n in shares.serving.items() if shares.of(z) > 0.0)
    assert waited_s >= 0.05 - 1e-6 or in_service == 0
    assert not any(shares.of(z) > 0.0 for z in free)  # a zone with a share and an idle worker takes it first
