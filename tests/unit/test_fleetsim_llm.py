"""The LLM fleet simulator: inferd's own LLMRuntime, engine and scheduler driven token by token on a
virtual clock. Same seed, same run; every stream gets exactly its tokens; steps slow down as the batch
grows; a full engine queue is refused with 429s by the real placement; shared prefixes hit the KV cache;
profiles load, round-trip and are fitted back from what bench-llm measures; the planner's arithmetic,
its JSON schema (shared with plan search) and its simulation check (of the deployment planned, shared
or partitioned, with every seed). Devices shared by every front end: every stream still gets exactly its
own tokens, a killed device is lost to all front ends, a closed link aborts only its front end's
sequences."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from inferd.cli.plan_llm import refuse_unplannable
from inferd.config import ConfigError
from inferd.fleetsim.llm_fleet import LLMFleet, LLMFleetSpec, simulate_llm
from inferd.fleetsim.llm_links import SharedLLMDevice
from inferd.fleetsim.llm_plan import CHECK_HEADROOM, LLMTargets, device_at, fits, holds, max_rate, plan_llm
from inferd.fleetsim.llm_profile import LLMProfile, bundled, fit_llm_steps, poisson_quantile
from inferd.fleetsim.llm_report import GapHistogram, LLMSimReport
from inferd.fleetsim.plan_schema import SCHEMA, search_report
from inferd.fleetsim.profiles import BatchProfile
from inferd.fleetsim.search_plan import SearchTargets, load_profile, plan_search
from tests.cli_flags import shared_devices_reach_the_fleet

DEVICE = LLMProfile(
    "test",
    step_base_s=0.005,
    per_token_s=0.00005,
    overhead_s=0.001,
    scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 256, "num_blocks": 512},
    source="given",
)


def spec(rate: float, devices: int = 2, duration: float = 8.0, prompt: int = 100, output: int = 20, **kw):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    times = np.cumsum(rng.exponential(1 / rate, int(rate * duration * 2) + 10))
    times = times[times < duration]
    n = times.size
    return LLMFleetSpec(DEVICE, devices, times, np.full(n, prompt), np.full(n, output), warmup_s=1.0, **kw)


def test_the_same_seed_gives_the_same_run() -> None:
    assert simulate_llm(spec(20)) == simulate_llm(spec(20))


def test_under_capacity_every_stream_gets_exactly_its_tokens() -> None:
    s = spec(20)
    fleet = LLMFleet(s)
    report = _run(fleet)
    assert report.rejected == report.failed == report.unfinished == 0
    assert report.ok == report.requests > 100
    assert fleet.tokens == [20] * s.arrivals.size
    assert report.ttft_p50_ms >= 1000 * (
        DEVICE.step_base_s + 100 * DEVICE.per_token_s
    )  # one prefill step at least
    assert report.itl_p50_ms >= 1000 * DEVICE.step_base_s
    assert report.output_tokens_per_s > 0.8 * 20 * report.offered_rps


def test_steps_slow_down_as_the_batch_grows() -> None:
    light, heavy = simulate_llm(spec(10)), simulate_llm(spec(80))
    assert heavy.mean_step_tokens > light.mean_step_tokens
    assert heavy.itl_p50_ms > light.itl_p50_ms
    assert heavy.ttft_p99_ms > light.ttft_p99_ms


def test_a_full_engine_queue_is_refused_by_the_real_placement() -> None:
    tight = LLMProfile(
        "tight",
        0.005,
        0.00005,
        scheduler={"max_num_seqs": 4, "max_waiting_seqs": 2, "max_num_batched_tokens": 256},
    )
    s = spec(200, devices=1, duration=4.0, output=100)
    s.profile = tight
    report = simulate_llm(s)
    assert report.rejected > 0
    assert report.ok + report.rejected == report.requests


def test_a_shared_prefix_hits_the_kv_cache() -> None:
    fleet = LLMFleet(spec(20, prompt=200, shared_prefix_tokens=160))
    _run(fleet)
    hits = sum(d.scheduler.statistics().prefix_hit_tokens for d in fleet.devices)
    assert hits > 0.5 * 160 * len(fleet.spec.arrivals)


def test_gap_histogram_percentiles_match_numpy() -> None:
    values = np.random.default_rng(1).lognormal(-4, 0.5, 50_000)
    h = GapHistogram()
    h.buffer.extend(values.tolist())
    for got, want in zip(h.percentiles_ms((50, 99)), np.percentile(values, [50, 99]) * 1000, strict=True):
        assert got is not None and math.isclose(got, want, rel_tol=0.01)


def test_profiles_load_round_trip_and_kinds_are_not_mixed(tmp_path: Path) -> None:
    published = bundled()
    assert published.source.startswith("published")
    assert published.kv_tokens() >= 300_000
    path = tmp_path / "p.json"
    DEVICE.save(path)
    assert LLMProfile.load(path) == DEVICE
    with pytest.raises(ConfigError, match="not a batch one"):
        BatchProfile.load(path)
    BatchProfile("b", 0.1, 0.001).save(path)
    with pytest.raises(ConfigError, match="not an llm one"):
        LLMProfile.load(path)


def test_step_costs_are_fitted_back_from_ttft_slope_and_mean_itl() -> None:
    base, per_token, tokens_per_s = 0.005, 0.00005, 3000.0
    points = [(p, 0.02 + per_token * p) for p in range(50, 500, 7)]
    sums = (len(points), sum(p for p, _ in points), sum(t for _, t in points),
            sum(p * p for p, _ in points), sum(p * t for p, t in points))  # fmt: skip
    mean_step = base / (1 - per_token * tokens_per_s)
    fitted_base, fitted_per_token = fit_llm_steps(sums, mean_step, tokens_per_s)
    assert math.isclose(fitted_per_token, per_token, rel_tol=1e-6)
    assert math.isclose(fitted_base, base, rel_tol=1e-6)


def test_the_planned_rate_meets_every_target_and_the_fleet_is_sized_by_it() -> None:
    t = LLMTargets(100_000, 500, 200, 1000, 100, device_cost_per_hour=2.0)
    profile = bundled()
    d, _ = max_rate(profile, t)
    assert fits(profile, t, d) is None
    assert fits(profile, t, device_at(profile, t, d.rate * 1.01)) is not None
    k = profile.per_token_s * 700 + profile.per_context_token_s * (500 + 200 * 600)
    assert math.isclose(d.k_s, k)
    assert math.isclose(d.step_s, profile.step_base_s / (1 - d.rate * k))
    assert poisson_quantile(d.rate * d.step_s, 0.99) == d.j99
    plan = plan_llm(profile, t, check=False)
    assert plan.resources.devices == math.ceil(100_000 / d.rate)
    fe_rps = 0.7 / (
        profile.frontend_s + 500 * profile.frontend_prompt_token_s + 200 * profile.frontend_token_s
    )
    assert plan.resources.frontends == math.ceil(100_000 / fe_rps) + 1
    assert plan.resources.cores == plan.resources.frontends + 2 * plan.resources.devices
    per_hour = plan.resources.devices * 2.0
    assert plan.cost is not None
    assert math.isclose(plan.cost.per_million_tokens, per_hour / (100_000 * 200 * 3600) * 1e6, rel_tol=1e-3)
    assert len(plan.reasoning) >= 6 and plan.check is None


def test_plan_json_has_one_schema_for_llm_and_search() -> None:
    llm = json.loads(plan_llm(bundled(), LLMTargets(1000, 500, 200, 1000, 100), check=False).to_json())
    profile, name = load_profile(None)
    search = json.loads(search_report(plan_search(profile, SearchTargets(1e6, 1000), name)).to_json())
    keys = {"schema", "kind", "inputs", "resources", "cost", "reasoning", "check", "profile", "details", "zones"}
    assert set(llm) == set(search) == keys
    assert llm["zones"]["zones"] == 1 and search["zones"] is None  # search plans no zones
    assert llm["schema"] == search["schema"] == SCHEMA
    assert set(llm["resources"]) == set(search["resources"])
    assert (llm["kind"], search["kind"]) == ("llm", "search")


def test_the_plan_is_checked_by_simulating_a_slice() -> None:
    t = LLMTargets(200, 100, 20, ttft_p99_ms=500, itl_p99_ms=50)
    plan = plan_llm(DEVICE, t, check=True, slice_devices=1, duration_s=8.0, seeds=1)
    check = plan.check
    assert check is not None and check["simulated"] and check["held"]
    last = check["runs"][-1]
    assert last["ttft_p99_ms"] <= 500 and last["itl_p99_ms"] <= 50
    assert plan.details["rate_per_device"] == last["rate_per_device"]


def test_a_slice_that_misses_the_slo_lowers_the_rate() -> None:
    # at the seat limit (max_num_seqs binds) requests queue for a seat, which the arithmetic leaves out
    t = LLMTargets(200, 100, 20, ttft_p99_ms=60, itl_p99_ms=50)
    plan = plan_llm(DEVICE, t, check=True, slice_devices=1, duration_s=8.0, seeds=1)
    assert plan.check is not None
    runs = plan.check["runs"]
    assert len(runs) > 1 and not runs[0]["held"] and runs[0]["ttft_p99_ms"] > 60
    assert runs[1]["rate_per_device"] == pytest.approx(0.9 * runs[0]["rate_per_device"], rel=1e-3)
    assert plan.details["rate_per_device"] < plan.details["analytic_rate_per_device"]


def test_the_slice_has_the_plans_front_ends_per_device_and_at_least_two() -> None:
    from inferd.fleetsim.llm_plan import slice_frontends

    # (slice devices, plan front ends, plan devices, want)
    cases = [(4, 1568, 3483, 2), (10, 1568, 3483, 5), (4, 2, 100, 2), (4, 100, 10, 4), (1, 2, 10, 1),
             (4, 1, 9, 1)]  # fmt: skip
    assert [slice_frontends(n, fe, d) for n, fe, d, _ in cases] == [want for *_, want in cases]


def test_the_check_simulates_the_planned_deployment_with_every_seed() -> None:
    # 3 devices over the plan's 2 front ends: shared, each device takes a third of the load; partitioned,
    # front end 1's one device takes half of it (front end 0 has devices 0 and 2) and queues
    t = LLMTargets(200, 100, 20, ttft_p99_ms=500, itl_p99_ms=50)
    shared = plan_llm(DEVICE, t, check=True, slice_devices=3, duration_s=4.0)
    split = plan_llm(DEVICE, t, check=True, slice_devices=3, duration_s=4.0, shared_devices=False, seeds=2)
    assert shared.check is not None and split.check is not None
    assert shared.resources.frontends == split.resources.frontends == 2
    assert (shared.check["shared_devices"], split.check["shared_devices"]) == (True, False)
    assert (shared.check["slice_frontends"], split.check["slice_frontends"]) == (2, 2)
    assert (shared.check["seeds"], split.check["seeds"]) == (3, 2)
    held = shared.check["runs"][-1]
    assert held["held"] and [r["seed"] for r in held["per_seed"]] == [0, 1, 2]
    assert held["ttft_p99_ms"] == max(r["ttft_p99_ms"] for r in held["per_seed"])
    assert held["itl_p99_ms"] == max(r["itl_p99_ms"] for r in held["per_seed"])
    assert held["slo_attainment"] == min(r["slo_attainment"] for r in held["per_seed"])
    first = split.check["runs"][0]  # the same rate as the shared slice's first
    assert first["rate_per_device"] == shared.check["runs"][0]["rate_per_device"]
    assert not first["held"] and len(first["per_seed"]) == 1  # the first seed that misses ends the rate
    assert first["ttft_p99_ms"] > 2 * shared.check["runs"][0]["ttft_p99_ms"]
    assert split.details["rate_per_device"] < shared.details["rate_per_device"]
    assert any("every worker joins every front end" in step for step in shared.reasoning)
    assert any(step.startswith("deployment (partitioned)") for step in split.reasoning)


def _run(fleet: LLMFleet):  # type: ignore[no-untyped-def]
    import asyncio

    async def main():  # type: ignore[no-untyped-def]
        return fleet.run()

    return asyncio.run(main())


def test_the_commands_print_a_simulation_and_a_plan_as_json() -> None:
    from typer.testing import CliRunner

    from inferd.cli.main import app

    runner = CliRunner()
    sim = runner.invoke(
        app,
        ["fleet-sim", "llm", "--devices", "1", "--rate", "5", "--duration", "4", "--warmup", "1", "--json"],
    )
    assert sim.exit_code == 0, sim.output
    out = json.loads(sim.output)
    assert out["ok"] == out["requests"] > 0 and out["profile_source"].startswith("published")
    plan = runner.invoke(
        app, ["plan", "llm", "--rps", "1000", "--no-check", "--device-cost-per-hour", "2", "--json"]
    )
    assert plan.exit_code == 0, plan.output
    report = json.loads(plan.output)
    assert (
        report["schema"] == SCHEMA and report["resources"]["devices"] > 0 and report["cost"]["per_hour"] > 0
    )


def test_plan_llm_simulates_the_deployment_and_seeds_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flags reach the simulated slices (the JSON's "check" only echoes them); each slice's run is
    recorded and answered with a report that holds."""
    from typer.testing import CliRunner

    from inferd.cli.main import app
    from inferd.fleetsim import llm_plan

    simulated: list[tuple[bool, int, int]] = []
    fields = dict.fromkeys(LLMSimReport.__dataclass_fields__, 0)

    def spy(s: LLMFleetSpec) -> LLMSimReport:
        simulated.append((s.shared_devices, s.frontends, s.seed))
        held = {"ttft_p99_ms": 100.0 + s.seed, "itl_p99_ms": 20.0, "slo_attainment": 1.0, "slo": {}}
        return LLMSimReport(**{**fields, **held})

    monkeypatch.setattr(llm_plan, "simulate_llm", spy)
    DEVICE.save(tmp_path / "device.json")
    args = ["plan", "llm", "--rps", "200", "--prompt-tokens", "100", "--output-tokens", "20", "--ttft-p99-ms",
            "500", "--itl-p99-ms", "50", "--device-profile", str(tmp_path / "device.json"),
            "--slice-devices", "2", "--check-seconds", "4"]  # fmt: skip
    for flags, shared in ((["--partitioned-devices", "--seeds", "2"], False), ([], True)):
        simulated.clear()
        plan = CliRunner().invoke(app, [*args, *flags, "--json"])
        assert plan.exit_code == 0, plan.output
        check = json.loads(plan.output)["check"]
        assert (check["shared_devices"], check["slice_frontends"]) == (shared, 2)
        assert check["seeds"] == (2 if flags else 3) and check["duration_s"] == 4
        assert json.loads(plan.output)["details"]["shared_devices"] is shared
        assert simulated == [(shared, 2, seed) for seed in range(check["seeds"])]
        assert check["held"] and len(check["runs"]) == 1
        assert check["runs"][0]["ttft_p99_ms"] == 100.0 + check["seeds"] - 1  # the worst seed's
    text = CliRunner().invoke(app, [*args, "--seeds", "1"])
    assert text.exit_code == 0, text.output
    assert "2 devices shared by 2 front end(s)" in text.output and "1 seed(s)" in text.output


def test_a_check_holds_only_with_its_p99s_inside_the_headroom() -> None:
    t = LLMTargets(200, 100, 20, ttft_p99_ms=1000, itl_p99_ms=100)
    fields = dict.fromkeys(LLMSimReport.__dataclass_fields__, 0)

    def report(ttft: float, itl: float) -> LLMSimReport:
        return LLMSimReport(**{**fields, "ttft_p99_ms": ttft, "itl_p99_ms": itl, "slo": {}})

    assert holds(t, report(500.0, CHECK_HEADROOM * 100))
    assert not holds(t, report(500.0, 100.0))  # at the target itself: too close to call
    assert not holds(t, report(CHECK_HEADROOM * 1000 + 1, 50.0))
    assert not holds(t, report(500.0, None))  # type: ignore[arg-type]


# ---- devices shared by every front end (as `inferd worker --connect a,b,...`) -------------------------


def shared_spec(devices: int = 3, frontends: int = 3, rate: float = 30.0, least: int = 5) -> LLMFleetSpec:
    """Each request asks for its own number of tokens (least + 0..22): a stream handed another's tokens
    ends with the wrong count (or never ends)."""
    s = spec(rate, devices=devices, duration=5.0, frontends=frontends, shared_devices=True)
    s.output_tokens = least + (np.arange(s.arrivals.size) * 7) % 23
    return s


def shared_devices(fleet: LLMFleet) -> list[SharedLLMDevice]:
    devices = [d for d in fleet.devices if isinstance(d, SharedLLMDevice)]
    assert len(devices) == len(fleet.devices)
    return devices


def test_shared_devices_give_every_stream_exactly_its_own_tokens() -> None:
    s = shared_spec()
    fleet = LLMFleet(s)
    report = _run(fleet)
    assert report.rejected == report.failed == report.unfinished == 0
    assert report.ok == report.requests > 80
    assert fleet.tokens == s.output_tokens.tolist()
    stats = [d.scheduler.statistics() for d in fleet.devices]
    assert sum(st.finished for st in stats) == s.arrivals.size  # one engine sequence per request
    assert sum(st.aborted + st.errored for st in stats) == 0
    for device in shared_devices(fleet):  # each engine served every front end's sequences
        assert [link.added > 0 for link in device.all_links] == [True] * 3
        assert sum(link.added for link in device.all_links) == device.scheduler.statistics().finished
    for runtime in fleet.frontends:  # and each front end has a connection to every device
        assert sorted(w.worker_id for w in runtime.members.connections()) == ["llm-0.0", "llm-1.0", "llm-2.0"]


def test_a_device_killed_by_one_front_end_is_lost_to_every_front_end() -> None:
    s = shared_spec(devices=2, frontends=2, rate=10.0, least=100)
    fleet = LLMFleet(s)
    doomed = fleet.devices[0]
    killer = fleet.frontends[0]
    fleet.events.at(2.0, killer.kill_worker, doomed.connections()[0][1])
    report = _run(fleet)
    assert doomed.dead
    for runtime in fleet.frontends:
        assert [w.worker_id for w in runtime.members.connections()] == ["llm-1.0"]
    assert report.ok == report.requests  # its streams resumed on the other device, no token lost or doubled
    assert fleet.tokens == s.output_tokens.tolist()
    assert fleet.devices[1].scheduler.statistics().finished > doomed.scheduler.statistics().finished


def test_a_link_one_front_end_closes_aborts_only_that_front_ends_sequences() -> None:
    s = shared_spec(devices=2, frontends=2, rate=10.0, least=100)
    fleet = LLMFleet(s)
    device = shared_devices(fleet)[0]
    closed = device.connections()[1][1]  # front end 1's connection to device 0
    fleet.events.at(2.0, closed.close)
    report = _run(fleet)
    assert not device.dead
    assert [w.worker_id for w in fleet.frontends[0].members.connections()] == ["llm-0.0", "llm-1.0"]
    assert [w.worker_id for w in fleet.frontends[1].members.connections()] == ["llm-1.0"]
    assert report.ok == report.requests  # front end 1's streams there resumed on the other device
    assert fleet.tokens == s.output_tokens.tolist()
    aborted = device.scheduler.statistics().aborted  # front end 1's sequences there when it left
    links = device.all_links
    assert aborted > 0 and links[1].added < links[0].added


def test_the_same_load_finishes_on_shared_and_on_partitioned_devices() -> None:
    for shared in (False, True):
        s = spec(40, devices=4, duration=5.0, frontends=2, shared_devices=shared)
        fleet = LLMFleet(s)
        report = _run(fleet)
        assert report.ok == report.requests > 120, shared
        assert fleet.tokens == [20] * s.arrivals.size, shared
        assert sum(d.scheduler.statistics().finished for d in fleet.devices) == s.arrivals.size, shared


def test_fleet_sim_llm_shares_devices_unless_partitioned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag reaches the simulated fleet (the JSON's "shared_devices" only echoes it); shared by
    default."""
    from inferd.cli import fleet_sim_llm

    shared_devices_reach_the_fleet(
        monkeypatch,
        fleet_sim_llm,
        "simulate_llm",
        ["fleet-sim", "llm", "--devices", "2", "--frontends", "2", "--rate", "5", "--duration", "4"],
    )


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [("rps", 0.0, "--rps"), ("rps", float("nan"), "--rps"), ("itl_p99_ms", 0.0, "--itl-p99-ms"),
     ("ttft_p99_ms", -1.0, "--ttft-p99-ms"), ("max_utilisation", 1.5, "--max-utilisation")],
)
def test_plan_targets_that_cannot_be_planned_are_refused_naming_the_flag(field: str, value: float, flag: str) -> None:
    settings = {"rps": 100.0, "prompt_tokens": 500, "output_tokens": 200, "ttft_p99_ms": 1000.0, "itl_p99_ms": 100.0}
    settings[field] = value
    with pytest.raises(ValueError, match=flag):
        refuse_unplannable(LLMTargets(**settings))  # type: ignore[arg-type]
