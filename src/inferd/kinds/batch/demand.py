"""The batch kind's autoscaling demand (`Kind.autoscaling`, runtime/demand.py): its models scale on
arrival rate against full-batch capacity, queue wait and busy ratio (the reasoning is in
fleet/autoscaler.py's docstring). The recommendation is a plain function of the observation; damping
(windows, cooldowns, steps) is the Autoscaler's, the same for every kind.

With several front ends (`--frontends N`) a batch model queues in each, so its queue depth, arrival rate
and busy ratio are the whole server's: the owner's own plus what the other front ends last reported
(`others`, runtime/frontend_load.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from inferd.clock import Clock
from inferd.config.autoscaler import AutoscalerConfig
from inferd.runtime.contract import RuntimeStatistics
from inferd.runtime.demand import Autoscaling, Clamp, Observed, Recommendation
from inferd.runtime.frontend_load import ArrivalMeter, FrontendLoads, model_load

FULL_BATCH_FRACTION = 0.8
"""Batches averaging at least this fraction of max_batch_size count as full: busy time is then work."""


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One measured point of the batch throughput curve."""

    batch_size: int
    latency_s: float


@dataclass(frozen=True, slots=True)
class Observation:
    """What the fleet looks like now, as measured (all rates and latencies are measured, never config)."""

    ready_workers: int
    starting_workers: int
    queue_depth_items: int
    arrival_rate_items_s: float
    max_batch_size: int
    busy_ratio: float
    """Fraction of the last window the ready workers spent running batches, 0..1."""
    batch_latency_s: float | None = None
    """EWMA of batch latency (DrainEstimator), None until a batch was measured."""
    items_per_batch: float | None = None
    """EWMA of batch size, None until a batch was measured."""
    throughput_curve: tuple[CurvePoint, ...] = ()
    """Measured (batch size, latency) points; when given, capacity is their best items per second."""

    def __post_init__(self) -> None:
        for name in ("ready_workers", "starting_workers", "queue_depth_items"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not (self.arrival_rate_items_s >= 0.0 and math.isfinite(self.arrival_rate_items_s)):
            raise ValueError(f"arrival_rate_items_s must be finite and >= 0, got {self.arrival_rate_items_s}")
        if not 0.0 <= self.busy_ratio <= 1.0:
            raise ValueError(f"busy_ratio must be within [0, 1], got {self.busy_ratio}")
        if self.batch_latency_s is not None and not self.batch_latency_s > 0.0:
            raise ValueError(f"batch_latency_s must be > 0, got {self.batch_latency_s}")
        for p in self.throughput_curve:
            if p.batch_size < 1 or not p.latency_s > 0.0:
                raise ValueError(f"throughput curve point {p} needs batch_size >= 1 and latency_s > 0")

    def capacity_per_worker_items_s(self) -> float | None:
        """Items per second one worker completes at full batches; None before any measurement."""
        if self.throughput_curve:
            return max(p.batch_size / p.latency_s for p in self.throughput_curve)
        if self.batch_latency_s is None:
            return None
        return self.max_batch_size / self.batch_latency_s

    def batches_full(self) -> bool:
        return (
            self.items_per_batch is not None
            and self.items_per_batch >= FULL_BATCH_FRACTION * self.max_batch_size
        )

    def signals(self) -> dict[str, Any]:
        return {
            "queued_items": self.queue_depth_items,
            "arrival_rate_items_s": round(self.arrival_rate_items_s, 3),
            "busy_ratio": round(self.busy_ratio, 3),
        }


class BatchObserver:
    """A batch model's observation: its snapshot, its arrival rate since the last look, and the other
    front ends' loads added to its own."""

    def __init__(self, clock: Clock) -> None:
        self._arrivals = ArrivalMeter(clock)

    def observe(self, stats: RuntimeStatistics, starting: int, others: FrontendLoads | None) -> Observation:
        d = stats.detail
        load = model_load(stats, self._arrivals.rate(stats.version, d.enqueued_total))
        if others is not None:
            load = others.total(load)
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


class BatchDemand:
    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config

    def recommend(self, obs: Observed, current: int, clamp: Clamp) -> Recommendation:
        if not isinstance(obs, Observation):
            raise TypeError(f"batch scaling needs an Observation, got {type(obs).__name__}")
        return self._recommend(obs, current, clamp)

    def _recommend(self, obs: Observation, current: int, clamp: Clamp) -> Recommendation:
        cfg = self.config
        capacity = obs.capacity_per_worker_items_s()
        busy_load = obs.busy_ratio * obs.ready_workers
        if capacity is None:
            return self._recommend_unmeasured(obs, current, busy_load, clamp)
        load = obs.arrival_rate_items_s / capacity
        source = f"arrival {obs.arrival_rate_items_s:.1f} items/s at {capacity:.1f} items/s per worker"
        if obs.batches_full() and busy_load > load:
            load, source = (
                busy_load,
                f"busy ratio {obs.busy_ratio:.2f} of {obs.ready_workers} full-batch workers",
            )
        need = math.ceil(load / cfg.target_busy_ratio - 1e-9)
        why = f"{source} is {load:.2f} workers of work; {need} keep busy ratio <= {cfg.target_busy_ratio:.2f}"
        wait_s = _predicted_wait_s(obs.queue_depth_items, obs.ready_workers * capacity)
        if wait_s > cfg.max_predicted_wait_s:
            drain = (obs.arrival_rate_items_s + obs.queue_depth_items / cfg.max_predicted_wait_s) / capacity
            if math.ceil(drain - 1e-9) > need:
                need = math.ceil(drain - 1e-9)
                why = (
                    f"predicted queue wait {wait_s:.2f} s ({obs.queue_depth_items} items) exceeds "
                    f"{cfg.max_predicted_wait_s:.2f} s; {need} workers drain it in time"
                )
        if (obs.arrival_rate_items_s > 0 or obs.queue_depth_items > 0) and need < 1:
            need, why = 1, f"{why}; work is arriving, so at least one worker"
        if need > current:
            return Recommendation(clamp(need), why)
        keep = math.ceil(load / (cfg.target_busy_ratio * (1.0 - cfg.scale_down_margin)) - 1e-9)
        keep = max(keep, need)
        if keep < current:
            floor = cfg.target_busy_ratio * (1.0 - cfg.scale_down_margin)
            why = f"{source} is {load:.2f} workers of work; {keep} stay below busy ratio {floor:.2f}"
            return Recommendation(clamp(keep), why)
        return Recommendation(clamp(current), f"{why}; within the hysteresis band at {current}")

    def _recommend_unmeasured(
        self, obs: Observation, current: int, busy_load: float, clamp: Clamp
    ) -> Recommendation:
        """No batch measured yet: grow on the busy ratio (or from zero on any work), never shrink."""
        need = math.ceil(busy_load / self.config.target_busy_ratio - 1e-9)
        if (obs.arrival_rate_items_s > 0 or obs.queue_depth_items > 0) and need < 1:
            need = 1
        if need > current:
            why = f"no batch measured yet; busy ratio {obs.busy_ratio:.2f} of {obs.ready_workers} workers"
            return Recommendation(clamp(need), why)
        return Recommendation(clamp(current), "no batch measured yet: holding (never shrink blind)")


def _predicted_wait_s(depth: int, fleet_capacity_items_s: float) -> float:
    if depth <= 0:
        return 0.0
    if fleet_capacity_items_s <= 0.0:
        return math.inf
    return depth / fleet_capacity_items_s


BATCH_AUTOSCALING = Autoscaling(BatchDemand, BatchObserver)
