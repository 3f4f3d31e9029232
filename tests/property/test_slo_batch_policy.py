"""SloBatchPolicy (kinds/batch/slo_policy.py) on its own: the hard cap, predicted latency within the budget,
bursts raising the batch size, lost items going after the ones that can still meet the SLO, the on-time
plan, the fixed fallback before the cost line is known, and the config check."""

from __future__ import annotations

import bisect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.kinds.batch.admission import DrainEstimator
from inferd.kinds.batch.arrival_rate import ArrivalRate
from inferd.kinds.batch.policy import BatchPolicy
from inferd.kinds.batch.slo_policy import SloBatchPolicy, batch_policy, budget_s
from inferd.models.sim import sim_config
from inferd.observability.slo_config import SloConfig

SLO = SloConfig(latency_ms=100.0, latency_target=0.99)
LINE = (0.020, 0.0005)


class Arrivals:
    def __init__(self) -> None:
        self.total = 0

    def __call__(self) -> int:
        return self.total


class Queued:
    """The queue as the policy sees it: when each queued item was enqueued."""

    def __init__(self, times: list[float] | None = None) -> None:
        self.times = sorted(times or [])

    def __call__(self, since: float) -> list[float]:
        return self.times[bisect.bisect_left(self.times, since) :]

    def decide(self, p: SloBatchPolicy, now: float, idle: int = 1, slots: int = 0, stage_at=None):
        oldest = self.times[0] if self.times else None
        return p.decide(now, len(self.times), oldest, idle, slots, stage_at)


def policy(
    cap: int = 256,
    line: tuple[float, float] | None = LINE,
    arrived: Arrivals | None = None,
    queued: Queued | None = None,
):
    q = queued if queued is not None else Queued()
    return SloBatchPolicy(SLO, cap, BatchPolicy(cap, 0.010), lambda: line, arrived or Arrivals(), q)


def cost(n: int, line: tuple[float, float] = LINE) -> float:
    return line[0] + line[1] * n


@settings(max_examples=300, deadline=None)
@given(
    cap=st.integers(1, 4096),
    ages=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=600),
    idle=st.integers(0, 4),
    slots=st.integers(0, 4),
    base=st.floats(0.0001, 0.2),
    per_item=st.floats(0.0, 0.01),
)
def test_never_cuts_more_than_the_hard_cap_or_the_queue(cap, ages, idle, slots, base, per_item):
    q = Queued([10.0 - a for a in ages])
    p = policy(cap, (base, per_item), queued=q)
    d = q.decide(p, 10.0, idle, slots)
    assert 0 <= d.size <= min(cap, len(ages))
    if d.size == 0 and d.wake_at is not None:
        assert d.wake_at > 10.0


@settings(max_examples=300, deadline=None)
@given(
    cap=st.integers(1, 512),
    ages=st.lists(st.floats(0.0, 0.3), min_size=1, max_size=400),
    base=st.floats(0.001, 0.05),
    per_item=st.floats(0.00001, 0.002),
)
def test_the_plan_is_the_largest_batch_whose_items_all_meet_the_budget(cap, ages, base, per_item):
    """A batch of the plan's size, of the oldest queued items enqueued at or after its `since`, finishes
    within the budget for every one of them, and one item more could not."""
    now = 10.0
    q = Queued([now - a for a in ages])
    p = policy(cap, (base, per_item), queued=q)
    plan = p.plan(now, (base, per_item))
    if plan is None:  # nothing can meet the budget even alone
        assert all(a + base + per_item > p.budget_s for a in ages)
        return
    chosen = q(plan.since)[: plan.size]
    assert len(chosen) == plan.size and chosen[0] == plan.oldest_at
    finish = now + base + per_item * plan.size
    assert all(finish - t <= p.budget_s + 1e-9 for t in chosen)
    bigger = plan.size + 1
    if bigger <= min(cap, len(ages)):
        assert len(q(now + base + per_item * bigger - p.budget_s)) < bigger


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(1.0, 1500.0), age=st.floats(0.0, 0.05), queued=st.integers(1, 300))
def test_steady_rate_waits_keep_predicted_latency_within_the_budget(rate, age, queued):
    """With a known line and a steady rate, a batch the policy holds is due while it, grown by the
    expected arrivals, is still predicted within the budget; a batch it cuts never costs more than the
    budget by itself."""
    arrived = Arrivals()
    q = Queued()
    p = policy(arrived=arrived, queued=q)
    now = 1.0
    for i in range(200):  # a steady stream: the rate estimate settles
        arrived.total += 1
        p.decide(now + i / rate, 0, None, 1, 0)
    now += 200 / rate
    oldest_at = now - age
    q.times = [oldest_at] * queued
    d = q.decide(p, now)
    for _ in range(5):  # each wake-up re-decides with the decayed rate estimate: a later wake-up, or the cut
        if d.size:
            break
        assert d.wake_at is not None and d.wake_at > now
        expected = queued + p.arrivals.rate * (d.wake_at - now)
        assert (d.wake_at - oldest_at) + LINE[0] + LINE[1] * expected <= p.budget_s + 1e-9
        assert d.wake_at - oldest_at <= LINE[0] / 2 + 1e-9  # and a free device waits at most a / 2
        now = d.wake_at
        d = q.decide(p, now)
        if d.size:
            assert now - oldest_at + cost(d.size) <= p.budget_s + 1e-9
    assert d.size >= 1
    assert cost(d.size) <= p.budget_s


def test_the_budget_leaves_room_for_what_the_policy_cannot_see():
    assert budget_s(SLO) == pytest.approx(0.098)
    assert budget_s(SloConfig(latency_ms=100.0, latency_target=0.999)) == pytest.approx(0.0975)


def test_a_burst_raises_the_batch_size():
    q = Queued([0.999] * 4)
    p = policy(queued=q)
    calm = q.decide(p, 1.0)
    calm_size = calm.size or q.decide(p, calm.wake_at).size
    q.times = [0.999] * 300
    burst = q.decide(p, 1.0)
    assert calm_size == 4
    assert calm_size < burst.size <= p.slo_size(LINE)
    assert 1.0 - 0.999 + cost(burst.size) <= p.budget_s


def test_items_that_cannot_meet_the_slo_go_after_the_ones_that_can():
    lost = [0.85] * 200  # waited 150 ms: past the SLO whatever happens
    fresh = [0.99] * 60  # waited 10 ms
    q = Queued(lost + fresh)
    p = policy(queued=q)
    d = q.decide(p, 1.0)
    assert d.size == 60 and d.since is not None and 0.85 < d.since <= 0.99
    assert p.statistics().late_batches == 0


def test_a_burst_gives_up_its_oldest_items_for_a_batch_that_meets_the_budget():
    q = Queued([0.93] * 100 + [0.999] * 100)  # the first 100 waited 70 ms: only a batch of 16 keeps them
    p = policy(queued=q)
    d = q.decide(p, 1.0)
    assert d.size == 100
    assert 0.93 < d.since <= 0.999  # the batch is the newer items: more of them meet the budget
    assert 1.0 - 0.999 + cost(d.size) <= p.budget_s


def test_lost_items_run_when_nothing_else_is_queued_oldest_first_up_to_the_slo_size():
    q = Queued([0.5] * 400)
    p = policy(queued=q)
    d = q.decide(p, 1.0)
    assert d.size == p.slo_size(LINE) and d.since is None  # a plain cut: the oldest first
    assert p.statistics().late_batches == 1
    assert Queued([0.5] * 7).decide(policy(queued=Queued([0.5] * 7)), 1.0).size == 7


def test_a_busy_worker_is_staged_only_a_batch_that_waiting_cannot_grow_near_the_end_of_its_run():
    q = Queued([0.999] * 10)
    p = policy(queued=q)
    assert q.decide(p, 1.0, idle=0, slots=1, stage_at=1.0).size == 0  # few items: it may still grow
    q.times = [0.995] * 300
    early = q.decide(p, 1.0, idle=0, slots=1, stage_at=1.02)
    assert early.size == 0 and early.wake_at == 1.02
    staged = q.decide(p, 1.02, idle=0, slots=1, stage_at=1.02)
    plan = p.plan(1.02 + 0.01, LINE)
    assert plan is not None and staged.size == plan.size and not staged.idle
    assert staged.since == plan.since
    q.times = [0.5] * 300
    assert q.decide(p, 1.02, idle=0, slots=1, stage_at=1.02).size == 0  # lost items wait for a free worker


def test_an_arrival_of_a_burst_cuts_a_waiting_batch_at_once():
    arrived = Arrivals()
    q = Queued([0.999] * 2)
    p = policy(arrived=arrived, queued=q)
    waiting = q.decide(p, 1.0)
    assert waiting.size == 0 and waiting.wake_at is not None
    arrived.total += 250
    q.times += [1.0005] * 250
    burst = q.decide(p, 1.0005)
    assert burst.size > 0 and burst.size < 252  # bounded by time: more than fits the budget are queued


@settings(max_examples=200, deadline=None)
@given(
    now=st.floats(0.0, 100.0),
    queued=st.integers(0, 500),
    age=st.floats(0.0, 1.0),
    idle=st.integers(0, 3),
    slots=st.integers(0, 3),
    stage_in=st.one_of(st.none(), st.floats(-0.1, 0.1)),
)
def test_before_the_cost_line_is_known_it_decides_as_the_fixed_policy(
    now, queued, age, idle, slots, stage_in
):
    fixed = BatchPolicy(64, 0.010)
    p = SloBatchPolicy(SLO, 64, BatchPolicy(64, 0.010), lambda: None, Arrivals(), Queued())
    oldest = None if queued == 0 else now - age
    stage_at = None if stage_in is None else now + stage_in
    assert p.decide(now, queued, oldest, idle, slots, stage_at) == fixed.decide(
        now, queued, oldest, idle, slots, stage_at
    )


def test_the_rate_estimate_follows_a_steady_stream_and_a_burst():
    r = ArrivalRate(0.1)
    total = 0
    for i in range(2000):
        total += 1
        r.update(i / 500.0, total)
    assert r.rate == pytest.approx(500.0, rel=0.05)
    total += 100
    assert r.update(4.0, total) > 1000.0


def test_batch_policy_follows_the_config():
    fixed = batch_policy(sim_config(), DrainEstimator(100), Arrivals(), Queued())
    assert isinstance(fixed, BatchPolicy)
    slo_config = sim_config(batching="slo", slo={"latency_ms": 100})
    slo = batch_policy(slo_config, DrainEstimator(100), Arrivals(), Queued())
    assert isinstance(slo, SloBatchPolicy)


def test_slo_batching_needs_an_slo_table_with_latency_ms():
    with pytest.raises(ValueError, match=r"no \[slo\] table: add one with latency_ms"):
        sim_config(batching="slo")
    with pytest.raises(ValueError, match="sets no latency_ms"):
        sim_config(batching="slo", slo={"availability": 0.99})
