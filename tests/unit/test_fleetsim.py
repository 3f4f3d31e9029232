"""The fleet simulator on its own: inferd's real ModelRuntime driven on a virtual clock by simulated
devices. Same seed, same run; a device-bound fleet saturates at its devices' capacity and refuses the
rest with 429s; killed devices lose no accepted request silently and come back; a lost front end fails
only what it held; arrival processes have the asked-for rate and burstiness; a profile is fitted back
from measured batch costs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from inferd.config import ConfigError
from inferd.fleetsim.arrivals import ArrivalSpec, arrival_times
from inferd.fleetsim.batch_fleet import Failure, FleetSpec, simulate
from inferd.fleetsim.profiles import BatchProfile, fit_cost_line
from inferd.models.sim import sim_config

DEVICE = BatchProfile("test", base_s=0.1, per_item_s=0.001, overhead_s=0.001, source="given")


def spec(rate: float, devices: int = 2, duration: float = 20.0, **kw) -> FleetSpec:  # type: ignore[no-untyped-def]
    times = arrival_times(ArrivalSpec("poisson", rate, seed=3), duration)
    return FleetSpec(sim_config(), DEVICE, devices, times, warmup_s=2.0, seed=1, **kw)


def test_the_same_seed_gives_the_same_run() -> None:
    assert simulate(spec(600)) == simulate(spec(600))


def test_under_capacity_everything_is_answered_and_latency_is_about_a_batch() -> None:
    report = simulate(spec(500))  # 2 devices x 500 req/s capacity each (100 items in 0.2 s)
    assert report.rejected == report.failed == report.timeouts == 0
    assert report.ok == report.requests
    assert math.isclose(report.throughput_rps, report.offered_rps)
    assert 0.1 < report.p50_ms / 1000 < 0.4


def test_overload_is_refused_with_429s_and_throughput_stays_at_capacity() -> None:
    report = simulate(spec(2000))  # twice the capacity
    capacity = 2 * 100 / DEVICE.batch_s(100)
    assert report.rejected > 0.3 * report.requests
    assert 0.85 * capacity <= report.throughput_rps <= 1.02 * capacity
    assert report.mean_batch_size > 90  # full batches under overload
    assert report.p99_ms is not None and report.p99_ms < 2000  # bounded queue: no runaway waits


def test_killed_devices_come_back_and_no_accepted_request_is_left_unanswered() -> None:
    report = simulate(spec(400, devices=4, failures=[Failure("kill", 5.0, fraction=0.5)], restart_s=1.0))
    assert report.restarts == 2
    assert report.timeouts == 0  # every accepted request got an answer: a result or an error
    assert report.ok + report.failed + report.rejected == report.requests
    assert report.ok > 0.95 * report.requests


def test_a_killed_share_is_spread_over_the_front_ends() -> None:
    """Half of 4 devices split between 2 front ends: one of each front end's 2, never all of one front
    end's (its requests would all fail, which is losing a front end, not a share of the devices)."""
    kill = [Failure("kill", 5.0, fraction=0.5)]
    report = simulate(spec(300, devices=4, frontends=2, failures=kill, restart_s=60.0, shared_devices=False))
    assert report.timeouts == 0
    assert report.ok > 0.95 * report.requests, report  # both front ends keep a device: ~nothing fails


def test_a_lost_front_end_fails_only_what_it_held() -> None:
    times = arrival_times(ArrivalSpec("poisson", 400, seed=3), 20.0)
    lose = Failure("lose_frontend", 10.0, index=0)
    split = FleetSpec(sim_config(), DEVICE, 4, times, frontends=2, warmup_s=2.0, failures=[lose], shared_devices=False)
    report = simulate(split)  # (shared devices: tests/unit/test_fleetsim_shared.py)
    assert 0 < report.failed < 0.05 * report.requests
    assert report.timeouts == 0
    assert report.ok + report.failed + report.rejected == report.requests


@pytest.mark.parametrize(("kind", "cv"), [("poisson", 1.0), ("gamma", 3.0), ("gamma", 0.5)])
def test_arrivals_have_the_rate_and_burstiness_asked_for(kind: str, cv: float) -> None:
    times = arrival_times(ArrivalSpec(kind, 1000.0, cv=cv, seed=5), 200.0)
    gaps = np.diff(times)
    assert times.size == pytest.approx(200_000, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_diurnal_arrivals_follow_the_curve_and_traces_are_read(tmp_path: Path) -> None:
    times = arrival_times(ArrivalSpec("diurnal", 1000.0, amplitude=0.8, period_s=100.0, seed=2), 100.0)
    first, third = ((times >= a) & (times < a + 25) for a in (0, 50))
    assert times[first].size > 2.5 * times[third].size  # the rising half vs the falling half
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"t": t, "size": 1}) for t in (0.5, 0.1, 3.0, 99.0)) + "\n")
    assert arrival_times(ArrivalSpec("trace", trace=trace), 10.0).tolist() == [0.1, 0.5, 3.0]
    trace.write_text('{"time": 1}\n')
    with pytest.raises(ConfigError, match=r"trace\.jsonl:1"):
        arrival_times(ArrivalSpec("trace", trace=trace), 10.0)


def test_a_cost_line_is_fitted_back_from_batches() -> None:
    rng = np.random.default_rng(0)
    points = {}
    for n in (4, 16, 40, 100):
        costs = (0.05 + 0.002 * n) * (1 + 0.05 * rng.standard_normal(400))
        points[n] = (400, float(costs.sum()), float((costs**2).sum()))
    base, per_item, cv = fit_cost_line(points)
    assert base == pytest.approx(0.05, rel=0.05)
    assert per_item == pytest.approx(0.002, rel=0.05)
    assert cv == pytest.approx(0.05, rel=0.2)


def test_profiles_round_trip_and_bad_ones_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    DEVICE.save(path)
    assert BatchProfile.load(path) == DEVICE
    path.write_text(json.dumps({"name": "x", "base_s": 0.1, "per_item_s": 0.0, "speed": 3}))
    with pytest.raises(ConfigError, match="unknown fields"):
        BatchProfile.load(path)


def test_the_servers_autoscaler_grows_the_fleet_under_load_and_shrinks_it_after() -> None:
    from inferd.config.autoscaler import AutoscalerConfig

    low = arrival_times(ArrivalSpec("poisson", 100, seed=1), 60)
    high = 60 + arrival_times(ArrivalSpec("poisson", 1500, seed=2), 60)
    after = 120 + arrival_times(ArrivalSpec("poisson", 100, seed=3), 200)
    times = np.concatenate([low, high, after])
    config = AutoscalerConfig(
        min_workers=1,
        max_workers=8,
        scale_up_cooldown_s=5,
        scale_down_cooldown_s=20,
        scale_down_stabilization_s=20,
    )
    report = simulate(FleetSpec(sim_config(), DEVICE, 1, times, autoscale=config, restart_s=2.0))
    assert report.devices_min == 1
    assert report.devices_max >= 3  # 1,500 req/s needs three devices of 500
    assert report.scale_changes >= 3  # up, then down again
    assert report.ok + report.rejected + report.failed == report.requests and report.failed == 0


def test_tenants_quotas_refuse_only_the_tenant_over_its_rate_and_weights_share_the_queue() -> None:
    from inferd.config.tenants import TenantConfig
    from inferd.fleetsim.tenants import SimTenant

    times = arrival_times(ArrivalSpec("poisson", 1500, seed=4), 20.0)  # 1.5x the devices' capacity
    tenants = [
        SimTenant("flood", 0.9, TenantConfig(requests_per_s=900.0, burst=100)),  # sends 1,350 req/s
        SimTenant("light", 0.1, TenantConfig()),  # sends 150 req/s, unlimited
    ]
    report = simulate(FleetSpec(sim_config(), DEVICE, 2, times, warmup_s=2.0, tenants=tenants))
    flood, light = report.tenants["flood"], report.tenants["light"]  # type: ignore[index]
    assert flood["limited"] > 0.25 * flood["requests"]  # ~450 of its 1,350 req/s over its quota
    assert light["limited"] == 0
    assert report.limited == flood["limited"]
    assert light["ok"] >= 0.99 * light["requests"]  # its fair share of the queue: no 429 for it
