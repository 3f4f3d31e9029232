"""How many zones a plan assumes, and what surviving the loss of one costs: the fleet sized so that the
zones left carry the whole load (`inferd plan llm --zones N`).

With N zones, each zone gets the same share of devices and front ends, and routing keeps a zone's
requests in it while it is healthy (docs/architecture.md, routing by zone). When one zone is lost, its
clients and its share of the load go to the N - 1 left, so each zone is sized for rps / (N - 1), not
rps / N:
  devices per zone    = ceil(rps / (N - 1) / r)     (partitioned: its front ends x their own devices)
  front ends per zone = ceil(rps / (N - 1) / front-end rps)
and the fleet is N times that. The cost of the loss's headroom is the difference from the fleet that
plans for no zone's loss (one zone: ceil(rps / r) devices and ceil(rps / front-end rps) + 1 front ends,
the spare surviving the loss of one front end), about 1 / (N - 1) more: +100% with 2 zones, +50% with 3.
A zone's front ends already survive the loss of one of them: a front end lost costs less than its zone.
While every zone is up, each device runs at (rps / N) / (devices per zone) requests/s, below r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ZoneSizing:
    zones: int
    devices_per_zone: int
    frontends_per_zone: int
    no_loss_devices: int
    """The devices of the plan for no zone's loss (one zone), to price the headroom against."""
    no_loss_frontends: int
    rps: float
    rate: float
    """Requests/s per device the plan holds to (r)."""

    @property
    def devices(self) -> int:
        return self.zones * self.devices_per_zone

    @property
    def frontends(self) -> int:
        return self.zones * self.frontends_per_zone

    def normal_rate(self) -> float:
        """Requests/s per device while every zone is up."""
        return self.rps / self.devices

    def to_dict(self, device_cost_per_hour: float | None) -> dict[str, Any]:
        extra = self.devices - self.no_loss_devices
        return {
            "zones": self.zones,
            "survives_zone_loss": self.zones > 1,
            "devices_per_zone": self.devices_per_zone,
            "frontends_per_zone": self.frontends_per_zone,
            "rps_per_zone": round(self.rps / self.zones, 3),
            "rps_per_zone_one_lost": round(self.rps / (self.zones - 1), 3) if self.zones > 1 else None,
            "rate_per_device_all_up": round(self.normal_rate(), 3),
            "rate_per_device_one_lost": round(self.rps / (self.devices - self.devices_per_zone), 3)
            if self.zones > 1
            else None,
            "no_loss_devices": self.no_loss_devices,
            "no_loss_frontends": self.no_loss_frontends,
            "headroom_devices": extra,
            "headroom_frontends": self.frontends - self.no_loss_frontends,
            "headroom_share": round(extra / self.no_loss_devices, 4),
            "headroom_cost_per_hour": round(extra * device_cost_per_hour, 2) if device_cost_per_hour else None,
        }


def size_zones(rps: float, rate: float, frontend_rps: float, zones: int, shared: bool) -> ZoneSizing:
    """The fleet for `rps` at `rate` per device and `frontend_rps` per front end over `zones` zones,
    sized so that any zones - 1 carry it; one zone: the plan without zone loss."""
    if zones < 1:
        raise ValueError(f"zones must be at least 1, not {zones}")
    no_loss_fe = math.ceil(rps / frontend_rps) + 1
    no_loss = _devices(rps, rate, no_loss_fe, shared)
    if zones == 1:
        return ZoneSizing(1, no_loss, no_loss_fe, no_loss, no_loss_fe, rps, rate)
    carried = rps / (zones - 1)
    fe_zone = math.ceil(carried / frontend_rps)
    return ZoneSizing(zones, _devices(carried, rate, fe_zone, shared), fe_zone, no_loss, no_loss_fe, rps, rate)


def _devices(rps: float, rate: float, frontends: int, shared: bool) -> int:
    if shared:
        return math.ceil(rps / rate)
    return frontends * math.ceil(rps / frontends / rate)  # an even split: each front end's own, <= r each


def zone_step(z: ZoneSizing, device_cost_per_hour: float | None) -> str:
    """The plan's reasoning step for its zones."""
    if z.zones == 1:
        return (
            "zones: 1 (no zone's loss planned for: a zone lost takes the whole fleet; --zones N sizes "
            "each of N zones so that N - 1 carry the load)"
        )
    extra = z.devices - z.no_loss_devices
    cost = f", {extra * device_cost_per_hour:,.2f}/h" if device_cost_per_hour else ""
    return (
        f"zones: {z.zones}, sized so that any {z.zones - 1} carry the load: each zone takes "
        f"{z.rps / z.zones:,.1f} req/s while all are up and {z.rps / (z.zones - 1):,.1f} when one is lost, so "
        f"devices per zone = ceil({z.rps / (z.zones - 1):,.1f} / {z.rate:.2f}) = {z.devices_per_zone:,} and "
        f"front ends per zone = {z.frontends_per_zone:,}; {z.zones} x {z.devices_per_zone:,} = {z.devices:,} "
        f"devices and {z.frontends:,} front ends. Losing a zone's headroom costs {extra:,} devices "
        f"({extra / z.no_loss_devices:+.0%} over the {z.no_loss_devices:,} a plan for no zone's loss needs"
        f"{cost}) and {z.frontends - z.no_loss_frontends:+,} front ends; while every zone is up each device "
        f"runs at {z.normal_rate():.2f} req/s ({z.normal_rate() / z.rate:.0%} of r)"
    )
