"""The search scatter with one replica of a shard slowed 10x, on virtual time (tests/search_fault_model.py
drives the front end's own ReplicaChooser and HedgePolicy): the search p99 stays within 1.3x of the
fault-free p99 and the extra shard requests within the 5% budget; without the slow verdict (a slow
replica back in the choice whenever its estimate has decayed) the same model misses the target.
Budget and probe invariants hold for any load, fault and work spread."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.kinds.search import replicas
from tests.search_fault_model import Model, Scenario, pooled

SEEDS = range(4)


def test_a_replica_slowed_10x_costs_at_most_1_3x_the_p99_and_5_percent_extra_requests() -> None:
    base_p99, base_extra = pooled(SEEDS, slow_factor=1)
    slow_p99, slow_extra = pooled(SEEDS)
    assert slow_p99 <= 1.3 * base_p99, (slow_p99, base_p99)
    assert slow_extra <= 0.05 and base_extra <= 0.05


def test_without_the_slow_verdict_the_model_misses_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replicas, "SLOW_RATIO", math.inf)  # never slow: decay brings it back every second
    base_p99, _ = pooled(SEEDS, slow_factor=1)
    slow_p99, _ = pooled(SEEDS)
    assert slow_p99 > 1.3 * base_p99, (slow_p99, base_p99)


def test_a_slowed_replica_gets_few_first_requests_and_its_share_back_after() -> None:
    model = Model(Scenario(duration_s=28.0))
    outcome = model.run()
    assert outcome.slow_share < 0.03  # probes (1%) and the calls before it was found slow
    assert outcome.recovered_share > 0.2  # fair share 50%: probes that answer first bring it back
    assert model.chooser.probes > 0


@settings(max_examples=25, deadline=None)
@given(
    rate=st.floats(20, 300),
    slow_factor=st.sampled_from([1.0, 2.0, 10.0, 50.0]),
    replicas_per_shard=st.integers(1, 3),
    sigma=st.floats(0.1, 1.2),
    seed=st.integers(0, 2**16),
)
def test_hedges_stay_within_the_budget_and_one_probe_at_a_time(
    rate: float, slow_factor: float, replicas_per_shard: int, sigma: float, seed: int
) -> None:
    scenario = Scenario(
        rate=rate,
        duration_s=3.0,
        slow_at_s=0.5,
        slow_s=2.0,
        slow_factor=slow_factor,
        replicas=replicas_per_shard,
        work_sigma=sigma,
        seed=seed,
    )
    model = Model(scenario)
    probes_in_flight: list[int] = []
    choose = model.chooser.choose

    def watched(candidates: list, min_seq: int, exclude: set, now: float = 0.0):  # type: ignore[no-untyped-def]
        choice = choose(candidates, min_seq, exclude, now)
        probes_in_flight.extend(r.load for r in candidates if r.slow and r is choice and not exclude)
        return choice

    model.chooser.choose = watched  # type: ignore[method-assign]
    outcome = model.run()
    assert outcome.searches > 0
    assert outcome.hedges <= 0.05 * outcome.requests + model.hedge.burst
    assert all(load == 0 for load in probes_in_flight)  # a probe goes only to an idle slow replica
