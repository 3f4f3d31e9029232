"""`inferd plan search`: the arithmetic from a shard profile (fleetsim/search_plan.py), and the in-process shard
profiler that makes the profile (kinds/search/shard_profile.py)."""

from __future__ import annotations

import math

import pytest

from inferd.config import ConfigError
from inferd.fleetsim.search_plan import SearchTargets, ShardCosts, candidate, load_profile, plan_search
from inferd.kinds.search.shard_profile import SCHEMA, ShardProfileSpec, profile_shards


def profile(lexical_b: float = 0.01, recall_b: float = -0.01) -> dict:
    """Costs in us: lexical 50 + lexical_b x n; dense at ef 32 / 64: 100 / 200 + 10 / 20 x ln n;
    recall 1.0 / 1.05 + recall_b x ln n (and measured so at 10,000 and 100,000); memory 100 MiB + 2,000 B a document (+ 4 x dim)."""
    fitted = {"32": 1.0, "64": 1.05}
    rows = [
        {"docs": n, "dense": {ef: {"recall@10": a + recall_b * math.log(n)} for ef, a in fitted.items()}}
        for n in (10_000, 100_000)
    ]
    return {
        "schema": SCHEMA,
        "spec": {"sizes": [10_000, 100_000], "dim": 384, "hnsw_m": 16, "ef_construction": 100},
        "rows": rows,
        "fit": {
            "lexical_cpu_us": {"a": 50.0, "b_per_doc": lexical_b},
            "dense": {
                "32": {
                    "cpu_us": {"a": 100.0, "b_per_ln_doc": 10.0},
                    "recall@10": {"a": 1.0, "b_per_ln_doc": recall_b},
                },
                "64": {
                    "cpu_us": {"a": 200.0, "b_per_ln_doc": 20.0},
                    "recall@10": {"a": 1.05, "b_per_ln_doc": recall_b},
                },
            },
            "memory_bytes": {"a": 100 * 2**20, "b_per_doc": 2000.0},
        },
        "http": {"frontend_cpu_ms_base": 0.5, "frontend_cpu_ms_per_shard": 0.1, "call_overhead_cpu_ms": 0.7},
    }


def test_one_shard_size_is_costed_step_by_step() -> None:
    t = SearchTargets(docs=1e8, qps=1e4, dim=384, recall=0.85, host_memory_gib=100, host_cores=32)
    n = 1_000_000
    c = candidate(ShardCosts(profile(), "test"), t, n)
    assert c is not None
    ln = math.log(n)
    assert c.ef_search == 32  # 1.0 - 0.01 ln(1e6) = 0.862 >= 0.85
    assert c.lexical_ms == pytest.approx((50 + 0.01 * n) / 1000, abs=1e-3)
    assert c.dense_ms == pytest.approx((100 + 10 * ln) / 1000, abs=1e-3)
    assert c.call_ms == pytest.approx(0.7 + c.lexical_ms + c.dense_ms, abs=2e-3)
    assert c.shards == 100
    assert c.replicas_per_shard == math.ceil(1e4 * c.call_ms / 1000 * 1.3)
    shard_bytes = 100 * 2**20 + n * 2000  # the profile's bytes a document, at its own dim
    assert c.shard_gib == pytest.approx(shard_bytes / 2**30, abs=0.01)
    assert c.replicas_per_host == min(32, math.floor(100 * 0.7 / c.shard_gib))
    assert c.replica_hosts == math.ceil(c.replica_processes / c.replicas_per_host)
    assert c.frontend_cpu_ms == pytest.approx(0.5 + 0.1 * 100)
    assert c.frontend_cores == math.ceil(1e4 * c.frontend_cpu_ms / 1000 * 1.3)


def test_a_higher_recall_takes_a_larger_ef_and_costs_more() -> None:
    costs = ShardCosts(profile(), "test")
    low = candidate(costs, SearchTargets(1e8, 1e4, recall=0.85), 1_000_000)
    high = candidate(costs, SearchTargets(1e8, 1e4, recall=0.95), 1_000_000)
    assert low is not None and high is not None
    assert (low.ef_search, high.ef_search) == (32, 64)
    assert high.dense_ms > low.dense_ms


def test_recall_is_interpolated_inside_the_profile_and_never_rises_beyond_it() -> None:
    costs = ShardCosts(profile(recall_b=-0.01), "test")
    between = 1.0 - 0.01 * math.log(30_000)
    assert costs.recall(30_000, 32) == pytest.approx(between)
    assert costs.recall(1e7, 32) == pytest.approx(1.0 - 0.01 * math.log(1e7))  # the fit, falling
    rising = profile(recall_b=0.001)
    rising["fit"]["dense"]["32"]["recall@10"] = {"a": 0.5, "b_per_ln_doc": 0.1}  # a hand-made rising fit
    assert ShardCosts(rising, "test").recall(1e9, 32) == pytest.approx(1.0 + 0.001 * math.log(100_000))


def test_the_plan_is_the_candidate_with_fewest_hosts_and_a_shard_that_fits_a_host() -> None:
    t = SearchTargets(docs=1e9, qps=1e5, recall=0.85, host_memory_gib=256, host_cores=64)
    plan = plan_search(profile(), t, "test")
    assert plan.chosen.hosts == min(c.hosts for c in plan.considered if c.call_ms <= t.max_call_ms)
    for c in plan.considered:  # every considered shard fits one host
        assert c.shard_gib <= 256 * 0.7
    assert max(c.docs_per_shard for c in plan.considered) == 10 * 100_000  # 10x the largest profiled
    report = plan.report()
    assert report.resources.cores == plan.chosen.replica_processes + plan.chosen.frontend_cores
    assert len(report.reasoning) >= 8


def test_cheaper_postings_make_larger_shards_pay() -> None:
    t = SearchTargets(docs=1e9, qps=1e5, recall=0.85)
    costly = plan_search(profile(lexical_b=0.01), t).chosen
    cheap = plan_search(profile(lexical_b=0.0001), t).chosen
    assert cheap.docs_per_shard >= costly.docs_per_shard
    assert cheap.hosts < costly.hosts


def test_a_fixed_shard_size_and_ef_are_used_as_given() -> None:
    plan = plan_search(profile(), SearchTargets(1e9, 1e5, docs_per_shard=2_000_000, ef_search=64))
    assert [c.docs_per_shard for c in plan.considered] == [2_000_000]
    assert (plan.chosen.shards, plan.chosen.ef_search) == (500, 64)
    with pytest.raises(ConfigError, match="not profiled"):
        plan_search(profile(), SearchTargets(1e9, 1e5, ef_search=100))


def test_a_larger_dim_costs_four_bytes_a_dimension_and_proportional_dense_time() -> None:
    costs = ShardCosts(profile(), "test")
    assert costs.bytes_per_doc(768) - costs.bytes_per_doc(384) == 4 * 384
    assert costs.dense_ms(1e6, 32, 768) == pytest.approx(2 * costs.dense_ms(1e6, 32, 384))


def test_a_cost_that_falls_with_size_is_held_at_its_largest_measurement() -> None:
    from inferd.kinds.search.shard_profile import cost_fit

    assert cost_fit([1.0, 2.0], [300.0, 200.0]) == (300.0, 0.0)
    assert cost_fit([1.0, 2.0], [300.0, 200.0], through_zero=True) == (0.0, 300.0)
    a, b = cost_fit([1.0, 2.0], [100.0, 200.0])
    assert (round(a), round(b)) == (0, 100)


def test_an_http_bench_report_is_not_a_shard_profile() -> None:
    with pytest.raises(ConfigError, match="shard profile"):
        plan_search({"latency_ms": {"p50": 5.0}}, SearchTargets(1e9, 1e6))


def test_the_bundled_profile_plans_a_billion_documents() -> None:
    data, name = load_profile(None)
    plan = plan_search(data, SearchTargets(1e9, 1e6, recall=0.95), name)
    c = plan.chosen
    assert c.shards * c.docs_per_shard >= 1e9
    assert c.recall >= 0.95
    assert c.replicas_per_shard >= 2 and c.hosts > 0


def test_the_profiler_measures_a_growing_shard() -> None:
    spec = ShardProfileSpec(
        sizes=(1000, 3000), dim=16, ef_search=(8, 64), vocab=2000, mean_len=20, clusters=20, queries=20,
        batch=500, build_threads=1, query_budget_s=2.0,
    )  # fmt: skip
    p = profile_shards(spec)
    assert p["schema"] == SCHEMA and [r["docs"] for r in p["rows"]] == [1000, 3000]
    for row in p["rows"]:
        assert row["lexical_cpu_us"] > 0 and row["hybrid_cpu_us"] > 0
        assert 0.0 <= row["dense"]["8"]["recall@10"] <= row["dense"]["64"]["recall@10"] <= 1.0
        assert row["dense"]["64"]["recall@10"] >= 0.9  # ef 64 over 3,000 vectors in 16 dims: near exact
    assert p["rows"][1]["rss_bytes"] > p["rows"][0]["rss_bytes"]
    assert set(p["fit"]["dense"]) == {"8", "64"}
    ShardCosts.from_profile(p, "fresh")  # what the planner reads


def test_profile_sizes_must_be_whole_batches() -> None:
    with pytest.raises(ValueError, match="multiples"):
        profile_shards(ShardProfileSpec(sizes=(1500,), batch=1000))
