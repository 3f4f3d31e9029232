"""The autoscaling driver: observe a model's default version every interval through its runtime's
snapshot, ask its Autoscaler (a pure policy), and act through fleet control (which starts workers, or
drains them before they go). Batch models scale on batching-aware signals, LLM models on their engines'
pressure (KV use, TTFT, waiting sequences).

With several front ends (`--frontends N`) the owner's loop runs alone, and a batch model's queue depth,
arrival rate and busy ratio are the whole server's: its own plus what the other front ends last
reported (`others`, fleet/frontend_load.py). An LLM model's engine statistics are already the whole
worker's (each engine reports its own totals to every front end)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from inferd.clock import Clock
from inferd.config import ConfigError
from inferd.fleet.autoscaler import Autoscaler, AutoscalerConfig, Decision
from inferd.fleet.control import FleetControl
from inferd.fleet.demand import BatchDemand, CurvePoint, LLMDemand, LLMObservation, Observation
from inferd.fleet.frontend_load import ArrivalMeter, FrontendLoads, model_load
from inferd.runtime.contract import RuntimeStatistics
from inferd.runtime.registry import ModelRegistry

log = logging.getLogger("inferd.autoscaler")

HISTORY = 20
"""Fleet changes kept for the admin API."""


def check_autoscalable(kind: str) -> None:
    """Only kinds whose workers are ours scale: an [autoscale] table on another is a start-up error."""
    if kind not in ("batch", "llm"):
        raise ConfigError(f"[autoscale] is set on a {kind} model, which has no workers of ours: remove it")


def scaling_policy(kind: str, config: AutoscalerConfig, clock: Clock) -> Autoscaler:
    check_autoscalable(kind)
    demand = LLMDemand(config) if kind == "llm" else BatchDemand(config)
    return Autoscaler(config, clock, demand)


class ScalingLoop:
    def __init__(
        self,
        registry: ModelRegistry,
        fleet: FleetControl,
        clock: Clock,
        model: str,
        autoscaler: Autoscaler,
        interval_s: float = 1.0,
        others: FrontendLoads | None = None,
    ) -> None:
        self.registry = registry
        self.fleet = fleet
        self.clock = clock
        self.model = model
        self.autoscaler = autoscaler
        self.interval_s = interval_s
        self.last: Decision | None = None
        self.changes: deque[tuple[float, Decision]] = deque(maxlen=HISTORY)
        """The latest decisions that changed the fleet, with their wall-clock time (for the admin API)."""
        self.others = others
        """The other front ends' reported loads (the owner of several front ends), else None."""
        self.observed: Observation | LLMObservation | None = None
        """The latest observation (for the admin API)."""
        self._arrivals = ArrivalMeter(clock)
        """The arrival rate of batch models."""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
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
            "observed": _observed(self.observed),
        }

    def observe(self) -> Observation | LLMObservation:
        stats = self.registry.get(self.model).statistics()
        starting = max(0, self.fleet.local_workers(self.model) - len(stats.workers))
        if stats.kind == "llm":
            return _llm_observation(stats, starting)
        return self._batch_observation(stats, starting)

    def _batch_observation(self, stats: RuntimeStatistics, starting: int) -> Observation:
        d = stats.detail
        load = model_load(stats, self._arrivals.rate(stats.version, d.enqueued_total))
        if self.others is not None:
            load = self.others.total(load)
        full = d.full_batch_latency_s
        return Observation(
            ready_workers=stats.ready_workers,
            starting_workers=starting,
            queue_depth_items=load.queued_items,
            arrival_rate_items_s=load.arrival_rate_items_s,
            max_batch_size=d.max_batch_size,
            busy_ratio=load.busy_ratio,
            batch_latency_s=d.batch_latency_s,
            items_per_batch=d.items_per_batch,
            throughput_curve=() if full is None else (CurvePoint(d.max_batch_size, full),),
        )


def _llm_observation(stats: RuntimeStatistics, starting: int) -> LLMObservation:
    d = stats.detail
    return LLMObservation(
        ready_workers=stats.ready_workers,
        starting_workers=starting,
        running_seqs=d.running,
        waiting_seqs=d.waiting,
        kv_usage=d.kv_blocks_used / d.kv_blocks_total if d.kv_blocks_total else 0.0,
        ttft_s=d.ttft_s,
    )


def _observed(obs: Observation | LLMObservation | None) -> dict[str, Any] | None:
    """The signals of the latest observation, as the admin API shows them."""
    if isinstance(obs, Observation):
        return {
            "queued_items": obs.queue_depth_items,
            "arrival_rate_items_s": round(obs.arrival_rate_items_s, 3),
            "busy_ratio": round(obs.busy_ratio, 3),
        }
    if isinstance(obs, LLMObservation):
        return {"running": obs.running_seqs, "waiting": obs.waiting_seqs, "kv_usage": round(obs.kv_usage, 3)}
    return None
