"""The batch fleet simulator with zones (FleetSpec.zones, `inferd fleet-sim run --zones N`): front ends,
devices and clients spread over the zones; each front end routes with the real runtime's zone policy
(routing/locality.py) built with its zone and the overprovisioning asked for, so most answers are served
in their front end's zone; a zone's loss (its front ends and devices at once) fails only what its front
ends held, its clients go to the other zones meanwhile, and after the heal its front ends and devices come
back and its clients are served in it again; the report per zone and per phase; the command's flags."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from inferd.cli.main import app
from inferd.fleetsim.arrivals import ArrivalSpec, arrival_times
from inferd.fleetsim.batch_fleet import BatchFleet, Failure, FleetSpec
from inferd.fleetsim.profiles import BatchProfile
from inferd.fleetsim.report import Outcome, SimReport
from inferd.fleetsim.zones import SimZones, zone_name
from inferd.models.sim import sim_config
from inferd.routing.locality import LocalityPolicy

DEVICE = BatchProfile("test", base_s=0.002, per_item_s=0.0005, overhead_s=0.001, source="given")
"""A full batch of 32 in 18 ms: ~1,800 items/s per device; a batch of a few items in about the batching
wait (5 ms). (A zone's work spills only when the zone is short of capacity, so the in-zone share does not
depend on the batch's cost below it: docs/fleet-sim.md, "Zones".)"""
LOSE_AT, HEAL_AT = 5.0, 10.0


def spec(rate: float = 900.0, devices: int = 6, frontends: int = 3, zones: int = 3, duration: float = 16.0, **kw) -> FleetSpec:  # type: ignore[no-untyped-def]
    times = arrival_times(ArrivalSpec("poisson", rate, seed=3), duration)
    model = sim_config(max_batch_size=32, max_wait_ms=5)
    return FleetSpec(model, DEVICE, devices, times, frontends, warmup_s=1.0, seed=1, zones=zones, **kw)


def run(s: FleetSpec) -> tuple[BatchFleet, SimReport]:
    async def main() -> tuple[BatchFleet, SimReport]:
        fleet = BatchFleet(s)
        return fleet, fleet.run()

    return asyncio.run(main())


LOSS = [Failure("lose_zone", LOSE_AT, index=1), Failure("heal_zone", HEAL_AT, index=1)]


def test_the_layout_and_each_front_end_routes_with_the_runtimes_zone_policy() -> None:
    fleet = BatchFleet(spec(frontends=6, overprovisioning=2.0))
    assert [fe.zone for fe in fleet.frontends] == [zone_name(i % 3) for i in range(6)]
    assert [d.zone for d in fleet.shared or ()] == [zone_name(d % 3) for d in range(6)]
    for fe in fleet.frontends:
        locality = fe.rt._routing.locality  # the runtime's own policy object, built as the server builds it
        assert isinstance(locality, LocalityPolicy)
        assert (locality.zone, locality.overprovisioning) == (fe.zone, 2.0)
        assert sorted(link.conn.zone for link in fe.devices) == sorted(zone_name(d % 3) for d in range(6))
    assert [zone_name(i) for i in (0, 1, 25, 26)] == ["zone-a", "zone-b", "zone-z", "zone-27"]
    with pytest.raises(ValueError, match="a front end in each"):
        BatchFleet(spec(frontends=2))
    with pytest.raises(ValueError, match="shared devices"):
        BatchFleet(spec(shared_devices=False))
    with pytest.raises(ValueError, match="zones must be at least 1"):
        SimZones(0, 10)


def test_without_zones_nothing_changes_and_no_zone_is_reported() -> None:
    fleet, report = run(spec(zones=0, duration=4.0))
    assert report.zones is None and fleet.zones is None
    assert all(fe.zone is None and fe.rt._routing.locality is None for fe in fleet.frontends)
    assert report.ok == report.requests


def test_clients_stay_in_their_zone_and_are_served_there() -> None:
    """At a seventh of the fleet's capacity every zone's own workers suffice: nearly every answer is served
    by a worker of its front end's zone (without the policy it would be about a third)."""
    fleet, report = run(spec(duration=6.0))
    assert report.ok == report.requests and report.zones is not None
    for name in ("zone-a", "zone-b", "zone-c"):
        z = report.zones[name]
        assert z["via_other_zone"] == 0 and z["failed"] == z["rejected"] == 0
        assert z["in_zone_share"] >= 0.95, (name, z)
        assert z["requests"] == pytest.approx(report.requests / 3, abs=2)
    assert report.zones["all"]["phases"] == []  # no zone lost: one phase
    client = np.arange(fleet.spec.arrivals.size) % 3
    admitted = fleet.zones.frontend_zone_of  # type: ignore[union-attr]
    assert (admitted[admitted >= 0] == client[admitted >= 0]).all()


def test_equally_busy_zones_near_their_capacity_keep_their_work() -> None:
    """At 80% of every zone's capacity no zone is short of it: its work waits for its own devices rather
    than trade spills with the others whenever one of theirs idles for a moment (which sent two thirds of
    the work across zones, with more 429s, under the rule before)."""
    _, report = run(spec(rate=8000.0, duration=3.0))
    assert report.zones is not None
    z = report.zones["all"]
    assert z["rejected"] == z["failed"] == 0, z
    assert z["in_zone_share"] >= 0.95, z


def test_a_lost_zone_fails_only_what_its_front_ends_held_and_comes_back_after_the_heal() -> None:
    s = spec(failures=LOSS)
    fleet, report = run(s)
    zones = report.zones
    assert zones is not None and zones["lost_at_end"] == []
    arrivals = s.arrivals
    failed = fleet.outcome == Outcome.FAILED
    # only what zone-b's front ends held at the loss: admitted there, arrived before it
    assert 0 < failed.sum() < 100
    assert (fleet.zones.frontend_zone_of[failed] == 1).all() and (arrivals[failed] < LOSE_AT).all()  # type: ignore[union-attr]
    assert zones["zone-a"]["failed"] == zones["zone-c"]["failed"] == 0
    assert report.rejected == report.timeouts == 0  # the zones left carry the load: 4 devices at ~20%
    before, during, after = zones["all"]["phases"]
    assert (before["from_s"], during["from_s"], after["from_s"]) == (1.0, LOSE_AT, HEAL_AT)
    assert during["goodput_rps"] >= 0.97 * during["requests"] / (HEAL_AT - LOSE_AT)
    b_during = zones["zone-b"]["phases"][1]
    assert b_during["via_other_zone"] == b_during["requests"] == b_during["ok"] > 0  # served elsewhere
    for name in ("zone-a", "zone-c"):  # the zones left keep their own clients in their own zone
        assert zones[name]["phases"][1]["in_zone_share"] >= 0.9, (name, zones[name])
    # after the heal: zone-b's front end and 2 devices are back, and its clients are served in it again
    assert report.restarts == 2
    live_b = [fe for fe in fleet.frontends if fe.zone == "zone-b" and not fe.lost]
    assert len(live_b) == 1 and live_b[0].index == 3 and live_b[0].devices
    assert all(len(fe.devices) == 6 for fe in fleet.frontends if not fe.lost)
    b_after = zones["zone-b"]["phases"][2]
    assert b_after["via_other_zone"] == 0 and b_after["failed"] == 0
    late = (arrivals >= HEAL_AT + 2.0) & (np.arange(arrivals.size) % 3 == 1) & (fleet.outcome == Outcome.OK)
    served = fleet.zones.served_zone_of[late]  # type: ignore[union-attr]
    assert (served == 1).mean() >= 0.9  # failback: the share came back to its zone


def test_a_zone_restarting_device_waits_for_its_zone() -> None:
    """A device of a lost zone that its supervisor restarts does not come back before the zone heals."""
    s = spec(duration=6.0, failures=[Failure("lose_zone", 2.0, index=2)], restart_s=1.0)
    fleet, report = run(s)
    assert report.restarts == 0 and report.zones is not None and report.zones["lost_at_end"] == ["zone-c"]
    assert [slot for slot, _, _ in fleet.zones.waiting["zone-c"]] == ["sim-2", "sim-5"]  # type: ignore[union-attr]
    assert all(not d.dead for d in fleet.shared or () if d.zone != "zone-c")


def test_the_same_seed_gives_the_same_run_with_zones() -> None:
    loss = [Failure("lose_zone", 2.0, index=0), Failure("heal_zone", 4.0, index=0)]
    assert run(spec(duration=6.0, failures=loss))[1] == run(spec(duration=6.0, failures=loss))[1]


def test_fleet_sim_run_takes_zones_and_reports_each() -> None:
    runner = CliRunner()
    base = ["fleet-sim", "run", "--devices", "6", "--frontends", "3", "--rate", "900", "--duration", "8",
            "--warmup", "1", "--base-ms", "2", "--per-item-ms", "0.5", "--max-batch-size", "32"]  # fmt: skip
    args = [*base, "--zones", "3", "--overprovisioning", "1.5", "--lose-zone", "1@3", "--heal-zone", "1@5"]
    out = runner.invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    zones = json.loads(out.output)["zones"]
    assert zones["overprovisioning"] == 1.5 and len(zones["zone-b"]["phases"]) == 3
    assert zones["zone-b"]["phases"][1]["via_other_zone"] > 0
    text = runner.invoke(app, args, env={"COLUMNS": "200"})  # the zones table whole
    assert text.exit_code == 0, text.output
    assert "zones (overprovisioning 1.5)" in text.output and "zone-b" in text.output
    for bad, says in (
        ([*base, "--lose-zone", "1@5"], "need --zones"),
        ([*base, "--zones", "4"], "a front end in each"),
        ([*base, "--zones", "3", "--lose-zone", "x@5"], "VALUE@SECONDS"),
        ([*base, "--zones", "3", "--heal-zone", "1.5@5"], "ZONE_INDEX@SECONDS"),
        ([*base, "--zones", "3", "--overprovisioning", "0.9"], "overprovisioning"),
    ):
        refused = runner.invoke(app, bad)
        assert refused.exit_code == 2 and says in refused.output, (bad, refused.output)
