"""What a simulated batch fleet is subjected to, at a virtual time: devices killed or slowed, a front end
lost, a whole zone lost and healed (fleetsim/zones.py). Each failure acts on the fleet as the real event
would on the server: a killed device's connection is lost (its supervisor restarts it later), a lost front
end's requests fail, a lost zone loses its front ends and its devices together and gets them back when
it heals."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from inferd.clock import FakeClock
from inferd.fleetsim.events import EventQueue
from inferd.fleetsim.report import Outcome
from inferd.fleetsim.zones import SimZones


class Fleet(Protocol):
    """What the failures act on (batch_fleet.BatchFleet)."""

    clock: FakeClock
    events: EventQueue
    spec: Any
    frontends: list[Any]
    shared: list[Any] | None
    zones: SimZones | None
    owner: np.ndarray
    outcome: np.ndarray
    done_at: np.ndarray
    items: list[Any]

    def kill(self, device: Any, reason: str) -> None: ...
    def restart(self, slot: str, generation: int, slowdown: float) -> None: ...
    def add_frontend(self, zone: str) -> Any: ...


@dataclass(frozen=True, slots=True)
class Failure:
    """At `at_s`: kill `fraction` of the devices ("kill"), slow one device by `factor` ("slow"), lose
    front end number `index` ("lose_frontend"), lose zone number `index` ("lose_zone": its front ends and
    devices at once) or bring it back ("heal_zone")."""

    kind: str
    at_s: float
    fraction: float = 0.0
    factor: float = 1.0
    index: int = 0


def inject(fleet: Fleet, failure: Failure) -> None:
    # round-robin over the front ends: a killed share is spread evenly, not one front end's whole set
    per_fe = [[d for d in fe.devices if not d.dead] for fe in fleet.frontends]
    devices = [d for group in itertools.zip_longest(*per_fe) for d in group if d is not None]
    if fleet.shared is not None:
        devices = [d for d in fleet.shared if not d.dead]
    if failure.kind == "kill":
        count = math.ceil(failure.fraction * len(devices))
        for device in devices[:count]:
            fleet.kill(device, "killed (simulated failure)")
    elif failure.kind == "slow" and devices:
        devices[0].slowdown = failure.factor
    elif failure.kind == "lose_frontend":
        lose_frontend(fleet, fleet.frontends[failure.index % len(fleet.frontends)])
    elif failure.kind in ("lose_zone", "heal_zone") and fleet.zones is not None:
        zone = fleet.zones.names[failure.index % len(fleet.zones.names)]
        (lose_zone if failure.kind == "lose_zone" else heal_zone)(fleet, zone)
    else:
        raise ValueError(f"unknown failure kind {failure.kind!r}" + (" (no zones)" if "zone" in failure.kind else ""))


def lose_frontend(fleet: Fleet, fe: Any) -> None:
    """Its requests fail (the clients see a broken connection); its devices join the others (shared
    devices close its links and serve the others on)."""
    fe.lost = True
    now = fleet.clock.now()
    for rid in np.flatnonzero((fleet.owner == fe.index) & (fleet.outcome == Outcome.PENDING)):
        fleet.outcome[rid] = Outcome.FAILED
        fleet.done_at[rid] = now
        fleet.items[rid] = None
    for device in list(fe.devices):
        if fleet.shared is not None:  # only its links close
            device.close()
            continue
        device.dead = True
        slot, _, generation = device.conn.worker_id.rpartition(".")
        fleet.events.at(now, fleet.restart, slot, int(generation) + 1, device.slowdown)
    fe.devices.clear()


def lose_zone(fleet: Fleet, zone: str) -> None:
    """The zone is cut off: its front ends are lost (what they held fails) and its devices are lost to
    every front end; none of them comes back (a restart waits) until the zone heals. Its clients go to
    the other zones' front ends meanwhile (fleetsim/zones.py, `frontend_for`)."""
    zones = fleet.zones
    assert zones is not None
    if zone in zones.lost:
        return
    zones.lost.add(zone)
    for fe in fleet.frontends:
        if fe.zone == zone and not fe.lost:
            lose_frontend(fleet, fe)
    for device in list(fleet.shared or ()):
        if device.zone == zone and not device.dead:
            fleet.kill(device, f"zone {zone} lost (simulated)")


def heal_zone(fleet: Fleet, zone: str) -> None:
    """The zone is back: its devices waiting for it restart (each joins every live front end), then as many
    front ends as it had start afresh, which every live device joins (their zone's among them from the
    start)."""
    zones = fleet.zones
    assert zones is not None
    if zone not in zones.lost:
        return
    zones.lost.discard(zone)
    for slot, generation, slowdown in zones.waiting.pop(zone, []):
        fleet.restart(slot, generation, slowdown)
    for _ in range(sum(1 for i in range(fleet.spec.frontends) if zones.frontend_zone(i) == zone)):
        fleet.add_frontend(zone)
