"""Traffic split and canary judge invariants on a FakeClock: the canary's share converges to its
weight, a sticky key always gets the same arm (on any front end), arm shares follow the configured
shares, and the judge rolls back exactly when one signal breaches both windows with enough requests."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.config.traffic import AB, Canary, Rollback, TrafficConfig
from inferd.gateway.canary_judge import ERROR_OUTCOMES, CanaryJudge
from inferd.gateway.traffic import TrafficSplit, sticky_fraction

DRAWS = 10_000


def canary_split(weight: float, seed: int) -> TrafficSplit:
    config = TrafficConfig(canary=Canary(version=2, weight=weight))
    return TrafficSplit("m", config, FakeClock(), random.Random(seed))


def test_a_five_percent_canary_gets_five_percent_within_one_point() -> None:
    split = canary_split(0.05, seed=7)
    share = sum(split.pick(1) == 2 for _ in range(DRAWS)) / DRAWS
    assert abs(share - 0.05) <= 0.01


@settings(max_examples=30, deadline=None)
@given(weight=st.floats(0.0, 1.0), seed=st.integers(0, 2**32))
def test_canary_share_converges_to_its_weight(weight: float, seed: int) -> None:
    split = canary_split(weight, seed)
    share = sum(split.pick(1) == 2 for _ in range(DRAWS)) / DRAWS
    sigma = math.sqrt(weight * (1 - weight) / DRAWS)
    assert abs(share - weight) <= max(0.01, 6 * sigma)  # binomial: 6 sigma misses ~1e-9


@settings(max_examples=50, deadline=None)
@given(
    keys=st.lists(st.text(min_size=0, max_size=20), min_size=1, max_size=20),
    share=st.floats(0.0, 1.0),
    seeds=st.tuples(st.integers(0, 2**32), st.integers(0, 2**32)),
)
def test_a_sticky_key_always_gets_the_same_arm_on_every_front_end(
    keys: list[str], share: float, seeds: tuple[int, int]
) -> None:
    config = TrafficConfig(ab=AB(arms={1: share, 2: 1.0 - share}, sticky_by="header:x-user"))
    front_ends = [TrafficSplit("m", config, FakeClock(), random.Random(s)) for s in seeds]
    for key in keys:
        arms = {fe.pick(1, key) for fe in front_ends for _ in range(3)}
        assert len(arms) == 1
        (arm,) = arms
        assert arm == (1 if sticky_fraction("m", key) < share else 2)
        if share in (0.0, 1.0):  # a zero-share arm never gets a key
            assert arm == (1 if share == 1.0 else 2)


def test_arm_shares_follow_the_configured_shares_over_many_keys() -> None:
    config = TrafficConfig(ab=AB(arms={1: 0.2, 2: 0.3, 3: 0.5}))
    split = TrafficSplit("m", config, FakeClock(), random.Random(1))
    counts = {1: 0, 2: 0, 3: 0}
    for i in range(DRAWS):
        counts[split.pick(1, f"tenant-{i}")] += 1
    for version, share in config.ab.arms.items():  # type: ignore[union-attr]
        assert abs(counts[version] / DRAWS - share) <= 0.02


# ---- the judge ------------------------------------------------------------------------------------
ROLLBACK = Rollback(max_error_ratio=0.2, short_window_s=10.0, long_window_s=60.0, min_requests=5)

event = st.tuples(
    st.floats(0.0, 5.0),  # seconds since the previous outcome
    st.booleans(),  # canary?
    st.booleans(),  # error?
)


def window(log: list[tuple[float, bool, bool]], now: float, span: float, canary: bool) -> tuple[int, int]:
    inside = [err for at, c, err in log if c == canary and at >= now - span]
    return len(inside), sum(inside)


def breaches(log: list[tuple[float, bool, bool]], now: float, span: float) -> bool | None:
    """The oracle for one window: None when it holds too few canary requests."""
    n, errors = window(log, now, span, canary=True)
    if n < ROLLBACK.min_requests:
        return None
    bn, berrors = window(log, now, span, canary=False)
    ratio, baseline = errors / n, (berrors / bn if bn else 0.0)
    return ratio > ROLLBACK.max_error_ratio and ratio > baseline  # type: ignore[operator]


@settings(max_examples=100, deadline=None)
@given(events=st.lists(event, min_size=1, max_size=150))
def test_rollback_fires_exactly_when_both_windows_breach_with_enough_requests(
    events: list[tuple[float, bool, bool]],
) -> None:
    clock = FakeClock()
    judge = CanaryJudge(ROLLBACK, clock)
    log: list[tuple[float, bool, bool]] = []
    error_outcome = sorted(ERROR_OUTCOMES)[0]
    for gap, canary, error in events:
        clock.advance(gap)
        judge.record(canary, error_outcome if error else "ok", 0.01)
        log.append((clock.now(), canary, error))
        now = clock.now()
        short, long = breaches(log, now, ROLLBACK.short_window_s), breaches(log, now, ROLLBACK.long_window_s)
        verdict = judge.verdict()
        assert (verdict is not None) == (short is True and long is True)
        if verdict is not None:
            assert verdict.signal == "error_ratio"
            assert all(w.requests >= ROLLBACK.min_requests for w in verdict.canary)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, ROLLBACK.min_requests - 1), gap=st.floats(0.0, 1.0))
def test_no_verdict_below_min_requests_even_when_every_canary_call_fails(n: int, gap: float) -> None:
    clock = FakeClock()
    judge = CanaryJudge(ROLLBACK, clock)
    for _ in range(100):
        judge.record(False, "ok", 0.01)
    for _ in range(n):
        clock.advance(gap)
        judge.record(True, "model_error", 5.0)
        assert judge.verdict() is None


@settings(max_examples=50, deadline=None)
@given(
    steps=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=5).map(lambda s: tuple(sorted(s))),
    ticks=st.lists(st.floats(0.0, 200.0), min_size=1, max_size=20),
)
def test_steps_advance_with_the_clock_and_only_a_last_step_of_one_promotes(
    steps: tuple[float, ...], ticks: list[float]
) -> None:
    clock = FakeClock()
    config = TrafficConfig(canary=Canary(version=2, steps=steps, step_interval_s=100.0))
    split = TrafficSplit("m", config, clock, random.Random(0))
    start, promoted = clock.now(), 0
    for tick in ticks:
        clock.advance(tick)
        decision = split.advance()
        promoted += type(decision).__name__ == "Promote"
        step = min(int((clock.now() - start) // 100.0), len(steps) - 1)
        if split.state == "promoted":
            assert steps[-1] >= 1.0 and step == len(steps) - 1
        else:
            assert split.weight == steps[step]
    assert promoted <= 1
