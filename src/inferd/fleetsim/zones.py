"""Zones in the batch fleet simulator (`inferd fleet-sim run --zones N`): which zone each front end,
device and client is in, which zones are lost, and what each zone's clients got.

The layout, as deploy/overlays/zones spreads a fleet: zone i of N is `zone-a`, `zone-b`, ...; front end f
is in zone f % N and device d in zone d % N (every device serves every front end, as there); client
request r comes from zone r % N and goes to a live front end of its own zone (round-robin among them, as
a Service with `trafficDistribution: PreferClose` sends it), or, while its zone has none, to a live front
end of another zone. Each front end's `ModelRuntime` routes with the real runtime's zone policy
(routing/locality.py, the front end's zone and `[cluster] overprovisioning`): the simulator only says
where things are.

A zone's loss (failures.py) loses its front ends and its devices together; a device of a lost zone that
its supervisor restarts waits here until the zone heals. The report (`summary`) is per client zone:
requests, goodput, failures by cause and p99, the share of its front ends' answers served by workers of
their own zone, and, when a zone is lost during the run, the same for the phases before, during and after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferd.fleetsim.report import Outcome

NOT_SET = -1


def zone_name(index: int) -> str:
    """zone-a, zone-b, ..., zone-z, zone-27, ..."""
    return f"zone-{chr(ord('a') + index)}" if index < 26 else f"zone-{index + 1}"


@dataclass(slots=True)
class SimZones:
    count: int
    requests: int
    names: list[str] = field(init=False)
    lost: set[str] = field(default_factory=set)
    waiting: dict[str, list[tuple[str, int, float]]] = field(default_factory=dict)
    """Per lost zone: the devices its supervisor would have restarted (slot, generation, slowdown)."""
    frontend_zone_of: np.ndarray = field(init=False)
    """Per request: the zone index of the front end that admitted it (NOT_SET: none did)."""
    served_zone_of: np.ndarray = field(init=False)
    """Per request: the zone index of the worker whose batch answered it (NOT_SET: none did)."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"zones must be at least 1, not {self.count}")
        self.names = [zone_name(i) for i in range(self.count)]
        self.frontend_zone_of = np.full(self.requests, NOT_SET, dtype=np.int16)
        self.served_zone_of = np.full(self.requests, NOT_SET, dtype=np.int16)

    # ---- the layout ------------------------------------------------------------------------------------
    def frontend_zone(self, index: int) -> str:
        return self.names[index % self.count]

    def device_zone(self, index: int) -> str:
        return self.names[index % self.count]

    def slot_zone(self, slot: str) -> str:
        """The zone of a device slot named MODEL-INDEX (batch_fleet names them so)."""
        return self.device_zone(int(slot.rpartition("-")[2]))

    def client_zone(self, rid: int) -> int:
        return rid % self.count

    def frontend_for(self, rid: int, live: list[Any]) -> Any:
        """The live front end that request `rid` reaches: one of its own zone's, else any (None: none)."""
        if not live:
            return None
        own = self.names[self.client_zone(rid)]
        local = [fe for fe in live if fe.zone == own]
        if local:
            return local[(rid // self.count) % len(local)]
        return live[rid % len(live)]

    # ---- what happened -------------------------------------------------------------------------------------
    def admitted(self, rid: int, frontend_zone: str) -> None:
        self.frontend_zone_of[rid] = self.names.index(frontend_zone)

    def answered(self, rid: int, worker_zone: str | None) -> None:
        if worker_zone in self.names:
            self.served_zone_of[rid] = self.names.index(worker_zone)

    def wait_for_heal(self, slot: str, generation: int, slowdown: float) -> bool:
        """A device restarting in a lost zone waits for the zone to heal (True); else it may start."""
        zone = self.slot_zone(slot)
        if zone not in self.lost:
            return False
        self.waiting.setdefault(zone, []).append((slot, generation, slowdown))
        return True

    # ---- the report ----------------------------------------------------------------------------------------
    def summary(
        self,
        outcome: np.ndarray,
        latency_ms: np.ndarray,
        arrivals: np.ndarray,
        warmup_s: float,
        end_s: float,
        failures: list[Any],
        overprovisioning: float,
    ) -> dict[str, Any]:
        """Per client zone over the measured window, and per phase when a zone is lost during it."""
        client = np.arange(arrivals.size) % self.count
        edges = sorted({f.at_s for f in failures if f.kind in ("lose_zone", "heal_zone") and warmup_s < f.at_s < end_s})
        bounds = [warmup_s, *edges, end_s]
        phases = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
        window = arrivals >= warmup_s
        out: dict[str, Any] = {"overprovisioning": overprovisioning, "lost_at_end": sorted(self.lost)}
        out["all"] = self._figures(outcome, latency_ms, window, end_s - warmup_s, None)
        out["all"]["phases"] = [
            {"from_s": a, "to_s": b, **self._figures(outcome, latency_ms, (arrivals >= a) & (arrivals < b), b - a, None)}
            for a, b in phases
        ] if len(phases) > 1 else []  # fmt: skip
        for z, name in enumerate(self.names):
            mine = client == z
            figures = self._figures(outcome, latency_ms, window & mine, end_s - warmup_s, z)
            if len(phases) > 1:
                figures["phases"] = [
                    {"from_s": a, "to_s": b,
                     **self._figures(outcome, latency_ms, mine & (arrivals >= a) & (arrivals < b), b - a, z)}
                    for a, b in phases
                ]  # fmt: skip
            out[name] = figures
        return out

    def _figures(
        self, outcome: np.ndarray, latency_ms: np.ndarray, chosen: np.ndarray, seconds: float, zone: int | None
    ) -> dict[str, Any]:
        """Requests `chosen`, over `seconds`: outcomes, goodput, p99; the in-zone share of their answers
        (served by a worker of the zone of the front end that admitted them); for one client zone, how
        many were admitted by another zone's front end."""
        ok = chosen & (outcome == Outcome.OK)
        served = ok & (self.served_zone_of != NOT_SET)
        in_zone = served & (self.served_zone_of == self.frontend_zone_of)
        figures: dict[str, Any] = {
            "requests": int(chosen.sum()),
            "ok": int(ok.sum()),
            "goodput_rps": round(int(ok.sum()) / max(1e-9, seconds), 3),
            "rejected": int((chosen & (outcome == Outcome.REJECTED)).sum()),
            "failed": int((chosen & (outcome == Outcome.FAILED)).sum()),
            "timeouts": int((chosen & (outcome == Outcome.TIMEOUT)).sum()),
            "p99_ms": round(float(np.percentile(latency_ms[ok], 99)), 3) if ok.any() else None,
            "in_zone_share": round(int(in_zone.sum()) / int(served.sum()), 4) if served.any() else None,
        }
        if zone is not None:
            admitted = chosen & (self.frontend_zone_of != NOT_SET)
            figures["via_other_zone"] = int((admitted & (self.frontend_zone_of != zone)).sum())
        return figures
