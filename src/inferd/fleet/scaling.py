"""The autoscaling driver: observe a model's default version every interval through its runtime's
snapshot and its kind's observer, ask its Autoscaler (a pure policy, with the kind's demand), and act
through fleet control (which starts workers, or drains them before they go). What a model scales on is
its kind's (`Kind.autoscaling`, runtime/demand.py): batch models on batching-aware signals
(kinds/batch/demand.py), LLM models on their engines' pressure (kinds/llm/demand.py).

It acts only while its front end holds the lease of the server's decisions (`acts`). With several front
ends (`--frontends N`) the owner's loop runs alone and hands its kind's observer the
other front ends' reported loads (`others`, runtime/frontend_load.py): a batch model's queue depth,
arrival rate and busy ratio are the whole server's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferd.clock import Clock
from inferd.config import ConfigError
from inferd.fleet.autoscaler import Autoscaler, AutoscalerConfig, Decision
from inferd.fleet.control import FleetControl
from inferd.runtime.demand import Autoscaling, Observed, Observer
from inferd.runtime.frontend_load import FrontendLoads
from inferd.runtime.kinds import Kind, KindRegistry
from inferd.runtime.registry import ModelRegistry

log = logging.getLogger("inferd.autoscaler")

HISTORY = 20
"""Fleet changes kept for the admin API."""


def check_autoscalable(kind: Kind) -> Autoscaling:
    """Only kinds that declare their autoscaling scale (those whose workers are ours: batch, llm): an
    [autoscale] table on another is a start-up error."""
    if kind.autoscaling is None:
        raise ConfigError(f"[autoscale] is set on a {kind.name} model, which has no workers of ours: remove it")
    return kind.autoscaling


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """One model's: its Autoscaler, with its kind's demand, and its kind's observer."""

    autoscaler: Autoscaler
    observer: Observer


def scaling_policy(kind: Kind, config: AutoscalerConfig, clock: Clock) -> ScalingPolicy:
    scaling = check_autoscalable(kind)
    return ScalingPolicy(Autoscaler(config, clock, scaling.demand(config)), scaling.observer(clock))


def scaling_loops(
    registry: ModelRegistry,
    fleet: FleetControl,
    clock: Clock,
    kinds: KindRegistry,
    others: FrontendLoads | None,
    acts: Callable[[], bool] | None,
) -> dict[str, ScalingLoop]:
    """A scaling loop for each served model whose default version has an [autoscale] table."""
    return {
        rt.name: ScalingLoop(
            registry,
            fleet,
            clock,
            rt.name,
            scaling_policy(kinds.get(rt.kind), rt.config.autoscale, clock),
            others=others,
            acts=acts,
        )
        for rt in registry.defaults()
        if rt.config.autoscale
    }


class ScalingLoop:
    def __init__(
        self,
        registry: ModelRegistry,
        fleet: FleetControl,
        clock: Clock,
        model: str,
        policy: ScalingPolicy,
        interval_s: float = 1.0,
        others: FrontendLoads | None = None,
        acts: Callable[[], bool] | None = None,
    ) -> None:
        self.registry = registry
        self.fleet = fleet
        self.clock = clock
        self.model = model
        self.autoscaler = policy.autoscaler
        self.observer = policy.observer
        self.interval_s = interval_s
        self.last: Decision | None = None
        self.changes: deque[tuple[float, Decision]] = deque(maxlen=HISTORY)
        """The latest decisions that changed the fleet, with their wall-clock time (for the admin API)."""
        self.others = others
        """The other front ends' reported loads (the owner of several front ends), else None."""
        self.observed: Observed | None = None
        """The latest observation (for the admin API)."""
        self.acts = acts
        """Whether this front end decides now (it holds the lease: cluster/lease.py); None: always."""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.acts is not None and not self.acts():
                continue  # another front end decides, or the store is down: no change from here
            self.observed = self.observe()
            decision = self.autoscaler.decide(self.observed)
            self.last = decision
            if decision.target_workers != decision.current_workers:
                self.changes.append((time.time(), decision))
                log.info(
                    "model %s: %s -> %d workers (%s)",
                    self.model,
                    decision.current_workers,
                    decision.target_workers,
                    decision.reason,
                )
                await self.fleet.scale_to(self.model, decision.target_workers)

    def report(self) -> dict[str, Any]:
        """The autoscaler's state for `inferd status`: its latest decision and its latest changes."""

        def row(d: Decision) -> dict[str, Any]:
            return {"from": d.current_workers, "to": d.target_workers, "reason": d.reason}

        return {
            "last": None if self.last is None else row(self.last),
            "changes": [{"at": round(at, 3), **row(d)} for at, d in self.changes],
            "observed": None if self.observed is None else self.observed.signals(),
        }

    def observe(self) -> Observed:
        stats = self.registry.get(self.model).statistics()
        starting = max(0, self.fleet.local_workers(self.model) - len(stats.workers))
        return self.observer.observe(stats, starting, self.others)
