"""The batch fleet simulator with devices shared by every front end (FleetSpec.shared_devices, the default
with several front ends): every request answered once; each device holds at most 1 running + 1 staged
batch in total across the front ends, because it runs the worker's own credit ledger (without credits the
same fleet holds more); every device serves every front end; a killed device is lost to all of them, a
lost front end only closes its links; batches keep their size when the same load is split over 3 front
ends; routed throughput scales with the front ends (and their devices); `inferd fleet-sim run
--shared-devices/--partitioned-devices` reaches the spec."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

from inferd.fleetsim.arrivals import ArrivalSpec, arrival_times
from inferd.fleetsim.batch_devices import SharedBatchDevice
from inferd.fleetsim.batch_fleet import BatchFleet, Failure, FleetSpec
from inferd.fleetsim.profiles import BatchProfile
from inferd.fleetsim.report import Outcome, SimReport
from inferd.fleetsim.validate import FULL, frontend_pids
from inferd.models.sim import sim_config
from inferd.wire.connection import WorkerState
from inferd.worker.credits import CAP
from tests.cli_flags import shared_devices_reach_the_fleet

DEVICE = BatchProfile("test", base_s=0.1, per_item_s=0.001, overhead_s=0.001, source="given")


def spec(rate: float, devices: int = 4, frontends: int = 3, duration: float = 10.0, **kw) -> FleetSpec:  # type: ignore[no-untyped-def]
    times = arrival_times(ArrivalSpec("poisson", rate, seed=3), duration)
    return FleetSpec(sim_config(), DEVICE, devices, times, frontends, warmup_s=1.0, seed=1, **kw)


def run(s: FleetSpec, without_credits: bool = False) -> tuple[BatchFleet, SimReport]:
    async def main() -> tuple[BatchFleet, SimReport]:
        fleet = BatchFleet(s)
        if without_credits:  # front ends that ignore the worker's grants (the control for the cap check)
            for fe in fleet.frontends:
                for link in fe.devices:
                    link.conn.credits = None
        return fleet, fleet.run()

    return asyncio.run(main())


def devices_of(fleet: BatchFleet) -> list[SharedBatchDevice]:
    assert fleet.shared is not None
    return fleet.shared


def test_several_front_ends_share_the_devices_unless_told_otherwise() -> None:
    fleet, _ = run(spec(500, devices=2, frontends=3, duration=2.0))
    assert len(devices_of(fleet)) == 2
    for fe in fleet.frontends:  # each front end has a credited connection to every device
        assert [link.device for link in fe.devices] == devices_of(fleet)
        assert all(link.conn.credits is not None for link in fe.devices)
    split, _ = run(spec(500, devices=2, frontends=2, duration=2.0, shared_devices=False))
    assert split.shared is None and [len(fe.devices) for fe in split.frontends] == [1, 1]
    alone, _ = run(spec(500, devices=2, frontends=1, duration=2.0))  # one front end: its own devices
    assert alone.shared is None and len(alone.frontends[0].devices) == 2


def test_the_shared_device_runs_the_workers_own_credit_code() -> None:
    """One policy code, two drivers: the device grants with the worker's CreditLedger through the worker's
    own tell_credits and take_batch (worker/fronts.py), over links that are the worker's FrontLinks."""
    from inferd.fleetsim import batch_devices
    from inferd.worker import fronts
    from inferd.worker.credits import CreditLedger

    assert batch_devices.tell_credits is fronts.tell_credits and batch_devices.take_batch is fronts.take_batch
    fleet, _ = run(spec(300, devices=1, frontends=3, duration=2.0))
    (device,) = devices_of(fleet)
    assert type(device.ledger) is CreditLedger and sorted(device.ledger.fronts()) == [0, 1, 2]
    assert all(isinstance(link, fronts.FrontLink) for link in device.links.values())
    assert device.ledger.statistics().granted > 0


def test_every_request_is_answered_exactly_once() -> None:
    s = spec(1500)  # about 75% of the 4 devices' capacity (500 req/s each at full batches)
    fleet, report = run(s)
    assert report.ok == report.requests > 10_000
    assert report.rejected == report.failed == report.timeouts == 0
    assert (fleet.outcome == Outcome.OK).all()
    assert fleet.batched_items == s.arrivals.size  # each request ran in one batch, none twice
    assert sum(link.batches for d in devices_of(fleet) for link in d.all_links) == fleet.batches


def test_a_device_never_holds_more_than_one_running_and_one_staged_batch_across_front_ends() -> None:
    fleet, report = run(spec(2000, frontends=4))  # at capacity: front ends fill batches, every device stages
    assert report.ok > 0.9 * report.requests
    for d in devices_of(fleet):
        assert d.most_held == CAP  # counted at the device: it staged, never beyond the cap
        assert d.ledger.high_water == CAP
    # the check bites: the same fleet whose front ends ignore the grants (each assumes 2 slots of its own)
    control, _ = run(spec(2000, frontends=4), without_credits=True)
    assert max(d.most_held for d in devices_of(control)) > CAP


def test_every_device_serves_every_front_end_under_load() -> None:
    fleet, _ = run(spec(1500, devices=5, frontends=4))
    for d in devices_of(fleet):
        served = [link.batches for link in d.all_links]
        assert len(served) == 4 and min(served) > 0.1 * sum(served), (d.worker_id, served)


def test_a_killed_device_is_lost_to_every_front_end() -> None:
    kill = Failure("kill", 4.0, fraction=0.25)  # one of 4 devices, never restarted within the run
    fleet, report = run(spec(1000, failures=[kill], restart_s=100.0))
    killed, *others = devices_of(fleet)
    assert killed.dead and not any(d.dead for d in others) and report.restarts == 0
    for fe in fleet.frontends:
        conns = fe.rt.members.connections()
        assert not any(link.conn in conns for link in killed.all_links)
        assert len(conns) == 3 and all(c.state is WorkerState.READY for c in conns)
    assert all(link.conn.state is WorkerState.DEAD for link in killed.all_links)
    assert report.timeouts == 0 and report.ok + report.failed + report.rejected == report.requests
    assert report.ok > 0.98 * report.requests  # the others took the load


def test_a_killed_device_comes_back_to_every_front_end() -> None:
    fleet, report = run(spec(1000, failures=[Failure("kill", 4.0, fraction=0.25)], restart_s=1.0))
    back = devices_of(fleet)[-1]
    assert report.restarts == 1 and back.worker_id == "sim-0.1"
    assert all(link.batches > 0 for link in back.all_links)
    assert all(len(fe.rt.members.connections()) == 4 for fe in fleet.frontends)


def test_a_lost_front_end_closes_only_its_links() -> None:
    s = spec(1000, failures=[Failure("lose_frontend", 4.0, index=1)])
    fleet, report = run(s)
    assert report.restarts == 0
    for d in devices_of(fleet):
        assert not d.dead and sorted(d.links) == [0, 2] and d.ledger.fronts() == [0, 2]
    assert all(len(fleet.frontends[i].devices) == 4 for i in (0, 2)) and not fleet.frontends[1].devices
    failed = fleet.outcome == Outcome.FAILED
    assert 0 < failed.sum() and (fleet.owner[failed] == 1).all()  # only what the lost one held
    later = s.arrivals >= 5.0
    assert (fleet.outcome[later] == Outcome.OK).all() and np.isin(fleet.owner[later], [0, 2]).all()


def test_batches_keep_their_size_when_the_load_is_split_over_three_front_ends() -> None:
    """The same arrivals on 2 devices behind 1 and behind 3 front ends: each front end keeps its own queue
    and batch policy, and sends a batch only against a slot the worker granted it. The mean batch (items
    per batch) with 3 stays >= 80% of one front end's, and nothing is refused."""
    for rate in (500, 800):  # 50% and 80% of the 2 devices' capacity at full batches
        one, alone = run(spec(rate, devices=2, frontends=1))
        three, shared = run(spec(rate, devices=2, frontends=3))
        assert alone.ok == shared.ok == alone.requests and alone.rejected == shared.rejected == 0
        assert shared.mean_batch_size >= 0.8 * alone.mean_batch_size, (rate, alone, shared)
        assert three.batches <= 1.25 * one.batches  # the same items in about as many batches


def test_routed_throughput_scales_with_the_front_ends_and_their_devices() -> None:
    """1 and 4 front ends, 2 shared devices per front end, the offered load scaled with them (80% of the
    devices' capacity): 4 front ends answer >= 0.8 x 4 times one's; past the devices' saturation (120%)
    too, each device at its capacity."""
    for load in (0.8, 1.2):
        _, one = run(spec(load * 1000, devices=2, frontends=1, duration=6.0))
        fleet, four = run(spec(load * 4000, devices=8, frontends=4, duration=6.0))
        assert four.throughput_rps >= 0.8 * 4 * one.throughput_rps, (load, one, four)
        assert four.failed == four.timeouts == 0
        assert all(d.ledger.high_water <= CAP for d in devices_of(fleet))
    assert one.rejected > 0 and four.rejected > 0  # 120%: the devices saturated, the queues refuse the rest


def test_fleet_sim_shares_devices_unless_partitioned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag reaches the simulated fleet (the JSON's "shared_devices" only echoes it); shared by
    default."""
    from inferd.cli import fleet_sim

    shared_devices_reach_the_fleet(
        monkeypatch,
        fleet_sim,
        "simulate",
        ["fleet-sim", "run", "--devices", "2", "--frontends", "2", "--rate", "200", "--duration", "3"],
    )


def test_validation_counts_the_cpu_of_every_front_end_process() -> None:
    """With several front ends the server's process is their parent: the calibration sums its children."""
    assert frontend_pids(os.getpid(), 1) == [os.getpid()]
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2)]
    try:
        assert {c.pid for c in children} <= set(frontend_pids(os.getpid(), 2))  # (and any other child)
    finally:
        for c in children:
            c.kill()
            c.wait()
    assert {2, 3} <= {case.frontends for case in FULL}  # the full validation has shared-worker cases
