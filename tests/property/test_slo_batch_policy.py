"""SloBatchPolicy (batching/slo_policy.py) on its own: the hard cap, predicted latency within the budget,
bursts raising the batch size, the fixed fallback before the cost line is known, and the config check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.batching.admission import DrainEstimator
from inferd.batching.arrival_rate import ArrivalRate
from inferd.batching.policy import BatchPolicy
from inferd.batching.slo_policy import SloBatchPolicy, batch_policy, budget_s
from inferd.models.sim import sim_config
from inferd.observability.slo_config import SloConfig

SLO = SloConfig(latency_ms=100.0, latency_target=0.99)
LINE = (0.020, 0.0005)


class Arrivals:
    def __init__(self) -> None:
        self.total = 0

    def __call__(self) -> int:
        return self.total


def policy(cap: int = 256, line: tuple[float, float] | None = LINE, arrived: Arrivals | None = None):
    return SloBatchPolicy(SLO, cap, BatchPolicy(cap, 0.010), lambda: line, arrived or Arrivals())


def cost(n: int, line: tuple[float, float] = LINE) -> float:
    return line[0] + line[1] * n


@settings(max_examples=300, deadline=None)
@given(
    cap=st.integers(1, 4096),
    queued=st.integers(1, 10_000),
    age=st.floats(0.0, 1.0),
    idle=st.integers(0, 4),
    slots=st.integers(0, 4),
    base=st.floats(0.0001, 0.2),
    per_item=st.floats(0.0, 0.01),
)
def test_never_cuts_more_than_the_hard_cap_or_the_queue(cap, queued, age, idle, slots, base, per_item):
    p = policy(cap, (base, per_item))
    d = p.decide(10.0, queued, 10.0 - age, idle, slots, None)
    assert 0 <= d.size <= min(cap, queued)
    if d.size == 0 and d.wake_at is not None:
        assert d.wake_at > 10.0


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(1.0, 1500.0), age=st.floats(0.0, 0.05), queued=st.integers(1, 300))
def test_steady_rate_waits_keep_predicted_latency_within_the_budget(rate, age, queued):
    """With a known line and a steady rate, a batch the policy holds is due while it, grown by the
    expected arrivals, is still predicted within the budget; a batch it cuts never costs more than the
    budget by itself."""
    arrived = Arrivals()
    p = policy(arrived=arrived)
    now = 1.0
    for i in range(200):  # a steady stream: the rate estimate settles
        arrived.total += 1
        p.decide(now + i / rate, 0, None, 1, 0)
    now += 200 / rate
    oldest_at = now - age
    d = p.decide(now, queued, oldest_at, 1, 0)
    for _ in range(5):  # each wake-up re-decides with the decayed rate estimate: a later wake-up, or the cut
        if d.size:
            break
        assert d.wake_at is not None and d.wake_at > now
        expected = queued + p.arrivals.rate * (d.wake_at - now)
        assert (d.wake_at - oldest_at) + LINE[0] + LINE[1] * expected <= p.budget_s + 1e-9
        assert d.wake_at - oldest_at <= LINE[0] / 2 + 1e-9  # and a free device waits at most a / 2
        now = d.wake_at
        d = p.decide(now, queued, oldest_at, 1, 0)
        if d.size:
            assert now - oldest_at + cost(d.size) <= p.budget_s + 1e-9
    assert d.size >= 1
    assert cost(d.size) <= p.budget_s


def test_the_budget_leaves_room_for_what_the_policy_cannot_see():
    assert budget_s(SLO) == pytest.approx(0.080)
    assert budget_s(SloConfig(latency_ms=100.0, latency_target=0.999)) == pytest.approx(0.075)


def test_a_burst_raises_the_batch_size():
    arrived = Arrivals()
    p = policy(arrived=arrived)
    calm = p.decide(1.0, 4, 0.999, 1, 0)
    calm_size = calm.size or p.decide(calm.wake_at, 4, 0.999, 1, 0).size
    burst = p.decide(1.0, 300, 0.999, 1, 0)
    assert calm_size == 4
    assert burst.size == p.slo_size(LINE) > calm_size
    assert cost(burst.size) <= p.budget_s


def test_a_lost_backlog_drains_at_the_device_limit():
    p = policy(cap=256)
    d = p.decide(1.0, 400, 0.9, 1, 0)  # the oldest waited 100 ms: it cannot meet the SLO any more
    assert d.size == 256
    assert p.statistics().drained == 1
    small = p.decide(1.0, 50, 0.9, 1, 0)  # a lost head but a short queue: everything, at once
    assert small.size == 50


def test_a_busy_worker_stages_only_a_batch_of_the_slo_size_near_the_end_of_its_run():
    p = policy()
    size = p.slo_size(LINE)
    assert p.decide(1.0, size - 1, 0.999, 0, 1, stage_at=1.0).size == 0
    early = p.decide(1.0, size + 5, 0.999, 0, 1, stage_at=1.02)
    assert early.size == 0 and early.wake_at == 1.02
    staged = p.decide(1.02, size + 5, 1.015, 0, 1, stage_at=1.02)
    assert staged.size == size and not staged.idle


def test_an_arrival_of_a_burst_cuts_a_waiting_batch_at_once():
    arrived = Arrivals()
    p = policy(arrived=arrived)
    waiting = p.decide(1.0, 2, 0.999, 1, 0)
    assert waiting.size == 0 and waiting.wake_at is not None
    arrived.total += 150
    assert p.decide(1.0005, 152, 0.999, 1, 0).size == p.slo_size(LINE)


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
    p = SloBatchPolicy(SLO, 64, BatchPolicy(64, 0.010), lambda: None, Arrivals())
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
    fixed = batch_policy(sim_config(), DrainEstimator(100), Arrivals())
    assert isinstance(fixed, BatchPolicy)
    slo = batch_policy(sim_config(batching="slo", slo={"latency_ms": 100}), DrainEstimator(100), Arrivals())
    assert isinstance(slo, SloBatchPolicy)


def test_slo_batching_needs_an_slo_table_with_latency_ms():
    with pytest.raises(ValueError, match=r"no \[slo\] table: add one with latency_ms"):
        sim_config(batching="slo")
    with pytest.raises(ValueError, match="sets no latency_ms"):
        sim_config(batching="slo", slo={"availability": 0.99})
