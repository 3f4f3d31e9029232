"""Autoscaling in the simulator: the server's own `ScalingLoop` observation (`observe`: the batch
runtime's snapshot -> an `Observation`) and `Autoscaler` policy (fleet/autoscaler.py, with the batch kind's demand: kinds/batch/demand.py),
asked every `interval_s` of virtual time as `ScalingLoop.run` asks them; the decision is carried out on
the simulated fleet: new devices join after `restart_s` (a worker's start), removed ones drain (they
finish what they hold, then leave), as `FleetControl.scale_to` does. One front end (the owner runs the
autoscaler)."""

from __future__ import annotations

from typing import Any

from inferd.config.autoscaler import AutoscalerConfig
from inferd.fleet.scaling import ScalingLoop, scaling_policy
from inferd.kinds.builtin import builtin_kinds
from inferd.runtime.registry import ModelRegistry


class SimScaling:
    def __init__(self, fleet: Any, config: AutoscalerConfig, interval_s: float = 1.0) -> None:
        """`fleet`: the simulated fleet (batch_fleet.BatchFleet: its clock, events, frontends,
        start_device and drain_one)."""
        self.fleet = fleet
        self.frontend = fleet.frontends[0]
        self.interval_s = interval_s
        registry = ModelRegistry()
        registry.add(self.frontend.rt)
        policy = scaling_policy(builtin_kinds().get(fleet.model.kind), config, fleet.clock)
        self.loop = ScalingLoop(registry, self, fleet.clock, fleet.model.name, policy, interval_s)  # type: ignore[arg-type]
        self.starting = 0
        self.changes = 0
        self.devices_seen: list[int] = []
        self._next_id = fleet.spec.devices

    # the FleetControl surface ScalingLoop.observe reads
    def local_workers(self, model: str, version: int | None = None) -> int:
        return sum(1 for d in self.frontend.devices if not d.draining) + self.starting

    def tick(self) -> None:
        decision = self.loop.autoscaler.decide(self.loop.observe())
        self.loop.last = decision
        current = self.local_workers(self.fleet.model.name)
        if decision.target_workers != current:
            self.changes += 1
        fleet = self.fleet
        now = fleet.clock.now()
        for _ in range(max(0, decision.target_workers - current)):
            self.starting += 1
            fleet.events.at(now + fleet.spec.restart_s, self._started)
        for _ in range(max(0, current - decision.target_workers)):
            fleet.drain_one(self.frontend)
        self.devices_seen.append(len(self.frontend.devices))
        fleet.events.at(now + self.interval_s, self.tick)

    def _started(self) -> None:
        self.starting -= 1
        self.fleet.start_device(self.frontend, f"{self.fleet.model.name}-{self._next_id}.0")
        self._next_id += 1
