"""Autoscaler invariants on a virtual clock (ROADMAP Part 2, RELIABILITY F8).

A small fluid model of a fleet drives the policy: a worker completes `CAPACITY_ITEMS_S` at full batches,
the queue grows when arrivals exceed the ready workers' capacity, and new workers become ready
`STARTUP_S` after the decision that asked for them (scale-down is instant here: draining is the
launcher's job, not the policy's).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.fleet.autoscaler import Action, Autoscaler, AutoscalerConfig, Decision
from inferd.kinds.batch.demand import BatchDemand, CurvePoint, Observation

TICK_S = 1.0
MAX_BATCH = 32
BATCH_LATENCY_S = 0.025
CAPACITY_ITEMS_S = MAX_BATCH / BATCH_LATENCY_S  # 1280 items/s per worker at full batches
STARTUP_S = 5.0


def batch_scaler(config: AutoscalerConfig, clock: FakeClock) -> Autoscaler:
    """The policy with the batch kind's demand (`Kind.autoscaling`), as the scaling loop builds it."""
    return Autoscaler(config, clock, BatchDemand(config))


@dataclass
class Change:
    at: float
    action: Action
    before: int
    after: int


@dataclass
class FleetSim:
    config: AutoscalerConfig
    ready: int
    clock: FakeClock = field(default_factory=FakeClock)
    starting: list[float] = field(default_factory=list)
    depth: float = 0.0
    decisions: list[tuple[float, Decision]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.scaler = batch_scaler(self.config, self.clock)

    def run(self, rate_items_s: float | list[float], ticks: int) -> None:
        for i in range(ticks):
            rate = rate_items_s[i] if isinstance(rate_items_s, list) else rate_items_s
            self.step(rate)

    def step(self, rate: float) -> Decision:
        self.clock.advance(TICK_S)
        now = self.clock.now()
        self.ready += sum(1 for t in self.starting if t <= now)
        self.starting = [t for t in self.starting if t > now]
        capacity = self.ready * CAPACITY_ITEMS_S * TICK_S
        work = self.depth + rate * TICK_S
        busy = min(1.0, work / capacity) if capacity else 0.0
        self.depth = max(0.0, work - capacity)
        obs = Observation(
            ready_workers=self.ready,
            starting_workers=len(self.starting),
            queue_depth_items=round(self.depth),
            arrival_rate_items_s=rate,
            max_batch_size=MAX_BATCH,
            busy_ratio=busy,
            batch_latency_s=BATCH_LATENCY_S,
            items_per_batch=max(1.0, MAX_BATCH * busy),
        )
        decision = self.scaler.decide(obs)
        self.decisions.append((now, decision))
        self.launch(decision.target_workers, now)
        return decision

    def launch(self, target: int, now: float) -> None:
        while self.ready + len(self.starting) < target:
            self.starting.append(now + STARTUP_S)
        while self.ready + len(self.starting) > target:
            if self.starting:
                self.starting.pop()
            else:
                self.ready -= 1

    @property
    def target(self) -> int:
        return self.decisions[-1][1].target_workers

    def changes(self, since: float = -math.inf) -> list[Change]:
        return [
            Change(t, d.action, d.current_workers, d.target_workers)
            for t, d in self.decisions
            if d.action is not Action.HOLD and t >= since
        ]


def cooldown_s(config: AutoscalerConfig, action: Action) -> float:
    return config.scale_up_cooldown_s if action is Action.UP else config.scale_down_cooldown_s


def assert_policy_invariants(sim: FleetSim) -> None:
    cfg = sim.config
    for _, d in sim.decisions:
        assert cfg.min_workers <= d.target_workers <= cfg.max_workers, d
    changes = sim.changes()
    for first, second in itertools.pairwise(changes):
        if second.before == 0 and second.action is Action.UP:
            continue  # a scale-up from zero waits for no cooldown: requests wait for a worker
        gap = second.at - first.at
        assert gap >= cooldown_s(cfg, second.action) - 1e-9, (first, second)
    for c in changes[1:]:  # the first decision may bring an out-of-range fleet within bounds
        if c.action is Action.UP:
            assert c.after - c.before <= cfg.max_step_up_workers, c
        else:
            assert c.before - c.after == 1, c


def settle_ticks(cfg: AutoscalerConfig) -> int:
    """Enough time to walk from any fleet size to the settled one, one cooled-down step at a time."""
    per_step = max(cfg.scale_down_cooldown_s, cfg.scale_down_stabilization_s, cfg.scale_up_cooldown_s)
    per_step += cfg.scale_up_stabilization_s + STARTUP_S + 2 * TICK_S
    return math.ceil((cfg.max_workers + 2) * per_step / TICK_S)


configs = st.builds(
    lambda mn, extra, target, margin, up_cd, down_extra, up_win, down_win, step, wait: AutoscalerConfig(
        min_workers=mn,
        max_workers=mn + extra,
        target_busy_ratio=target,
        scale_down_margin=margin,
        scale_up_cooldown_s=up_cd,
        scale_down_cooldown_s=up_cd + down_extra,
        scale_up_stabilization_s=up_win,
        scale_down_stabilization_s=down_win,
        max_step_up_workers=step,
        max_predicted_wait_s=wait,
    ),
    st.integers(0, 3),
    st.integers(1, 6),
    st.sampled_from([0.5, 0.6, 0.7, 0.8, 0.9]),
    st.sampled_from([0.0, 0.1, 0.2, 0.3]),
    st.integers(0, 20).map(float),
    st.integers(0, 60).map(float),
    st.sampled_from([0.0, 0.0, 3.0, 10.0]),
    st.sampled_from([0.0, 10.0, 30.0]),
    st.integers(1, 3),
    st.sampled_from([0.2, 0.5, 2.0]),
)


@settings(max_examples=60, deadline=None)
@given(
    cfg=configs,
    start=st.integers(0, 12),
    phases=st.lists(
        st.tuples(st.floats(0.0, 12.0), st.integers(1, 90)),  # (workers' worth of load, ticks)
        min_size=1,
        max_size=8,
    ),
)
def test_target_stays_within_bounds_and_changes_respect_cooldowns_and_steps(cfg, start, phases) -> None:
    sim = FleetSim(cfg, ready=start)
    for load_workers, ticks in phases:
        sim.run(load_workers * CAPACITY_ITEMS_S, ticks)
    assert_policy_invariants(sim)


@settings(max_examples=40, deadline=None)
@given(cfg=configs, start_fraction=st.floats(0.0, 1.0), load_fraction=st.floats(0.0, 1.0))
def test_constant_load_settles_to_at_most_one_more_change(cfg, start_fraction, load_fraction) -> None:
    start = cfg.min_workers + round(start_fraction * (cfg.max_workers - cfg.min_workers))
    rate = load_fraction * cfg.max_workers * cfg.target_busy_ratio * CAPACITY_ITEMS_S
    sim = FleetSim(cfg, ready=start)
    sim.run(rate, settle_ticks(cfg))
    settled_at = sim.clock.now()
    sim.run(rate, settle_ticks(cfg))
    assert len(sim.changes(since=settled_at + TICK_S)) <= 1, sim.changes(since=settled_at)
    assert_policy_invariants(sim)
    if rate > 0:  # the settled fleet carries the load (within the bound of max_workers)
        assert sim.target * CAPACITY_ITEMS_S >= rate or sim.target == cfg.max_workers


def step_config(n0: int, up_cd: float, down_cd: float, up_win: float, step: int) -> AutoscalerConfig:
    return AutoscalerConfig(
        min_workers=n0,
        max_workers=4 * n0 + 2,
        target_busy_ratio=0.7,
        scale_up_cooldown_s=up_cd,
        scale_down_cooldown_s=down_cd,
        scale_up_stabilization_s=up_win,
        scale_down_stabilization_s=30.0,
        max_step_up_workers=step,
        max_predicted_wait_s=0.5,
    )


@settings(max_examples=40, deadline=None)
@given(
    n0=st.integers(1, 4),
    up_cd=st.integers(0, 30).map(float),
    down_extra=st.integers(0, 120).map(float),
    up_win=st.sampled_from([0.0, 5.0]),
    step=st.integers(1, 2),
)
def test_step_to_150_percent_scales_up_in_bounded_time_and_back_down_only_after_cooldown(
    n0, up_cd, down_extra, up_win, step
) -> None:
    cfg = step_config(n0, up_cd, up_cd + down_extra, up_win, step)
    base_capacity = n0 * CAPACITY_ITEMS_S
    sim = FleetSim(cfg, ready=n0)
    sim.run(0.2 * base_capacity, settle_ticks(cfg))
    assert sim.target == n0 and not sim.changes()

    # 20% -> 150%: first step within the up-window (+1 tick); enough workers within the bounded walk
    step_at = sim.clock.now()
    needed = math.ceil(1.5 * n0 / cfg.target_busy_ratio)
    steps = math.ceil((needed - n0) / step)
    first_bound = math.ceil(up_win / TICK_S) + 2
    walk_bound = first_bound + steps * (math.ceil(up_cd / TICK_S) + 1)
    sim.run(1.5 * base_capacity, walk_bound)
    ups = sim.changes(since=step_at)
    assert ups and ups[0].action is Action.UP
    assert ups[0].at - step_at <= first_bound * TICK_S
    assert all(c.action is Action.UP for c in ups)
    assert sim.target >= needed
    # the backlog built while workers started may have grown the fleet past `needed`: it trims back
    # to the hysteresis band, never below what carries the load
    sim.run(1.5 * base_capacity, settle_ticks(cfg))
    assert needed <= sim.target <= math.ceil(1.5 * n0 / (0.7 * (1 - cfg.scale_down_margin)))
    last_change = sim.changes()[-1]

    # back to 20%: no scale-down before the scale-down cooldown has passed since the last change
    drop_at = sim.clock.now()
    sim.run(0.2 * base_capacity, settle_ticks(cfg))
    downs = sim.changes(since=drop_at)
    assert downs and all(c.action is Action.DOWN for c in downs)
    assert downs[0].at - last_change.at >= cfg.scale_down_cooldown_s
    assert downs[0].at - drop_at >= cfg.scale_down_stabilization_s
    assert sim.target == n0
    assert_policy_invariants(sim)


@settings(max_examples=30, deadline=None)
@given(
    level_workers=st.floats(0.3, 7.0),
    seed=st.integers(0, 2**32 - 1),
    margin=st.sampled_from([0.2, 0.3]),
    target=st.sampled_from([0.6, 0.7, 0.8]),
)
def test_noisy_load_around_a_level_does_not_flap(level_workers, seed, margin, target) -> None:
    cfg = AutoscalerConfig(
        min_workers=1,
        max_workers=12,
        target_busy_ratio=target,
        scale_down_margin=margin,
        scale_up_cooldown_s=10.0,
        scale_down_cooldown_s=60.0,
        scale_down_stabilization_s=30.0,
    )
    rng = random.Random(seed)
    level = level_workers * CAPACITY_ITEMS_S
    ticks = 2 * settle_ticks(cfg)
    rates = [level * rng.uniform(0.9, 1.1) for _ in range(ticks)]
    sim = FleetSim(cfg, ready=1)
    sim.run(rates[: ticks // 2], ticks // 2)
    settled_at = sim.clock.now()
    sim.run(rates[ticks // 2 :], ticks - ticks // 2)
    after = sim.changes(since=settled_at + TICK_S)
    assert len(after) <= 1, after
    # the fleet may overshoot while the first workers start (a backlog builds) and trim back once,
    # but never turns around again: up, down, up would be flapping
    actions = [c.action for c in sim.changes()]
    turns = sum(1 for a, b in itertools.pairwise(actions) if a != b)
    assert turns <= 1, sim.changes()
    assert_policy_invariants(sim)


def test_wait_above_max_scales_up_even_when_the_rate_looks_covered() -> None:
    clock = FakeClock()
    scaler = batch_scaler(AutoscalerConfig(min_workers=1, max_workers=4, max_predicted_wait_s=0.5), clock)
    obs = Observation(
        ready_workers=2,
        starting_workers=0,
        queue_depth_items=5000,  # 5000 / 2560 items/s = 1.95 s predicted wait
        arrival_rate_items_s=100.0,
        max_batch_size=MAX_BATCH,
        busy_ratio=1.0,
        batch_latency_s=BATCH_LATENCY_S,
        items_per_batch=MAX_BATCH,
    )
    decision = scaler.decide(obs)
    assert decision.action is Action.UP and decision.target_workers == 3
    assert "predicted queue wait 1.95 s" in decision.reason


def test_small_busy_batches_are_not_mistaken_for_saturation() -> None:
    """Workers 90% busy running batches of 2 could batch 16x more: the rate decides, not the busy time."""
    clock = FakeClock()
    cfg = AutoscalerConfig(min_workers=1, max_workers=8, scale_down_cooldown_s=60.0)
    scaler = batch_scaler(cfg, clock)
    curve = (CurvePoint(1, 0.020), CurvePoint(32, 0.0232))
    obs = Observation(
        ready_workers=4,
        starting_workers=0,
        queue_depth_items=0,
        arrival_rate_items_s=200.0,
        max_batch_size=MAX_BATCH,
        busy_ratio=0.9,
        batch_latency_s=0.0202,
        items_per_batch=2.0,
        throughput_curve=curve,
    )
    first = scaler.decide(obs)
    assert first.action is Action.HOLD  # a fresh policy has not watched a full scale-down window
    clock.advance(cfg.scale_down_stabilization_s)
    second = scaler.decide(obs)
    assert second.target_workers == 3, second  # one step at a time, towards 1
    assert "0.14 workers of work" in second.reason


def test_without_a_measured_batch_the_busy_ratio_grows_the_fleet_and_nothing_shrinks_it() -> None:
    clock = FakeClock()
    scaler = batch_scaler(
        AutoscalerConfig(
            min_workers=0,
            max_workers=4,
            scale_up_cooldown_s=0.0,
            scale_down_cooldown_s=0.0,
            scale_down_stabilization_s=0.0,
        ),
        clock,
    )

    def obs(ready: int, busy: float, rate: float) -> Observation:
        return Observation(ready, 0, 0, rate, MAX_BATCH, busy)

    assert scaler.decide(obs(0, 0.0, 5.0)).target_workers == 1  # scale from zero on any work
    clock.advance(100)
    assert scaler.decide(obs(1, 1.0, 5.0)).target_workers == 2
    clock.advance(100)
    assert scaler.decide(obs(2, 0.0, 0.0)).target_workers == 2


def test_statistics_count_decisions_and_changes_per_minute() -> None:
    clock = FakeClock()
    cfg = AutoscalerConfig(min_workers=1, max_workers=8, scale_up_cooldown_s=10.0, scale_down_cooldown_s=30.0)
    sim = FleetSim(cfg, ready=1, clock=clock)
    sim.run(3.0 * CAPACITY_ITEMS_S, 40)
    stats = sim.scaler.statistics()
    assert stats.decisions == 40
    assert stats.scale_ups == len(sim.changes()) >= 2
    assert stats.scale_downs == 0
    assert stats.target_workers == sim.target
    assert stats.last_change_at == sim.changes()[-1].at
    assert stats.changes_last_minute == stats.scale_ups
    clock.advance(120)
    assert sim.scaler.statistics().changes_last_minute == 0


def test_config_rejects_contradictions_with_a_fix() -> None:
    with pytest.raises(ValueError, match="raise max_workers or lower min_workers"):
        AutoscalerConfig(min_workers=5, max_workers=2)
    with pytest.raises(ValueError, match="scale-down must be the slower direction"):
        AutoscalerConfig(scale_up_cooldown_s=60.0, scale_down_cooldown_s=10.0)
    with pytest.raises(ValueError, match="busy_ratio"):
        Observation(1, 0, 0, 1.0, MAX_BATCH, 1.5)
