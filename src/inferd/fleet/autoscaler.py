"""How many workers a model should have: a batching-aware scaling policy (ROADMAP Part 2, RELIABILITY F8).

A plain object with an injected clock and no I/O. The driver feeds it one `Observation` per tick and
hands the `Decision` to the launcher. The decision only says *how many* workers; which worker goes and
how (drain first, then stop: zero failed in-flight requests) is the launcher's job, as is replacing a
worker that died while the target did not change.

The signals are batching-aware. A worker's capacity is what it completes at full batches
(`max_batch_size / latency`), or the best point of a measured throughput curve, so a worker that is
busy running small batches is not mistaken for a saturated one (it would absorb more load by batching
more). From capacity and the measured arrival rate:

* demand: `arrival_rate / capacity_per_worker` workers' worth of work, kept at `target_busy_ratio`;
* queue wait: `queue_depth / fleet capacity`; above `max_predicted_wait_s` the fleet must also drain
  the backlog within that time, `(arrival_rate + depth / max_predicted_wait_s) / capacity_per_worker`;
* busy ratio: counts as demand only while batches run near full (then busy time is proportional to
  work), or while no batch has been measured yet (the only signal there is).

Damping, in order: a hysteresis band (scale down only if one worker fewer would still sit below target
by `scale_down_margin`), Kubernetes-HPA stabilization windows (scale up to the *lowest*
recommendation of the up-window, down to the *highest* of the down-window, and never before a
down-window has been observed in full), cooldowns measured from the
last change in either direction (so a reversal waits the cooldown of its own direction), and a bounded
step (up by at most `max_step_up_workers`, down by one). The target is always within
[min_workers, max_workers].
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inferd.clock import Clock

FULL_BATCH_FRACTION = 0.8
"""Batches averaging at least this fraction of max_batch_size count as full: busy time is then work."""

RATE_WINDOW_S = 60.0
"""The window of `AutoscalerStats.changes_last_minute`."""


class AutoscalerConfig(BaseModel):
    """Scaling policy for one model's fleet."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_workers: int = Field(default=1, ge=0)
    """Fewest workers, whatever the load (0 allows scale to zero)."""
    max_workers: int = Field(default=8, ge=1)
    """Most workers, whatever the load."""
    target_busy_ratio: float = Field(default=0.7, gt=0.0, le=1.0)
    """Fraction of full-batch capacity the fleet should run at; the rest is headroom for bursts."""
    max_predicted_wait_s: float = Field(default=0.5, gt=0.0)
    """Predicted queue wait (depth / fleet capacity) above which the fleet grows to drain the backlog."""
    scale_down_margin: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Hysteresis: scale down only if one worker fewer would run below target_busy_ratio x (1 - margin).
    0.2 keeps ±10% noise in the measured rate from flapping the fleet (1.1 / 0.9 < 1 / 0.8)."""
    scale_up_cooldown_s: float = Field(default=15.0, ge=0.0)
    """After any change, wait this long before scaling up."""
    scale_down_cooldown_s: float = Field(default=120.0, ge=0.0)
    """After any change, wait this long before scaling down (longer than the scale-up cooldown)."""
    scale_up_stabilization_s: float = Field(default=0.0, ge=0.0)
    """Scale up to the lowest recommendation seen over this window (0: react to the latest)."""
    scale_down_stabilization_s: float = Field(default=60.0, ge=0.0)
    """Scale down to the highest recommendation seen over this window."""
    max_step_up_workers: int = Field(default=1, ge=1)
    """Most workers added by one decision (a scale-down always removes one)."""

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalerConfig:
        if self.max_workers < self.min_workers:
            raise ValueError(
                f"max_workers ({self.max_workers}) is below min_workers ({self.min_workers}): "
                "raise max_workers or lower min_workers"
            )
        if self.scale_down_cooldown_s < self.scale_up_cooldown_s:
            raise ValueError(
                f"scale_down_cooldown_s ({self.scale_down_cooldown_s}) is shorter than scale_up_cooldown_s "
                f"({self.scale_up_cooldown_s}): scale-down must be the slower direction; raise it"
            )
        return self


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


class Action(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True, slots=True)
class Decision:
    """How many workers the fleet should have. Scale-down drains first: that is the launcher's job."""

    target_workers: int
    reason: str
    current_workers: int

    @property
    def action(self) -> Action:
        if self.target_workers > self.current_workers:
            return Action.UP
        if self.target_workers < self.current_workers:
            return Action.DOWN
        return Action.HOLD


@dataclass(frozen=True, slots=True)
class AutoscalerStats:
    decisions: int
    scale_ups: int
    scale_downs: int
    target_workers: int | None
    last_change_at: float | None
    changes_last_minute: int
    last_reason: str | None


@dataclass(frozen=True, slots=True)
class _Recommendation:
    workers: int
    why: str


class Autoscaler:
    """Feed `decide(observation)` once per tick; it returns the target fleet size and why."""

    def __init__(self, config: AutoscalerConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self._target: int | None = None
        self._first_seen_at: float | None = None
        self._history: deque[tuple[float, int]] = deque()
        self._last_change_at: float | None = None
        self._changes: deque[float] = deque()
        self._decisions = 0
        self._ups = 0
        self._downs = 0
        self._last_reason: str | None = None

    def decide(self, obs: Observation) -> Decision:
        now = self.clock.now()
        if self._first_seen_at is None:
            self._first_seen_at = now
        current = self._target if self._target is not None else obs.ready_workers + obs.starting_workers
        rec = self._recommend(obs, current)
        self._remember(now, rec.workers)
        decision = self._stabilize(now, now - self._first_seen_at, current, rec)
        self._record(now, decision)
        return decision

    def statistics(self) -> AutoscalerStats:
        now = self.clock.now()
        recent = sum(1 for t in self._changes if now - t <= RATE_WINDOW_S)
        return AutoscalerStats(
            decisions=self._decisions,
            scale_ups=self._ups,
            scale_downs=self._downs,
            target_workers=self._target,
            last_change_at=self._last_change_at,
            changes_last_minute=recent,
            last_reason=self._last_reason,
        )

    # -- recommend: how many workers the latest observation alone asks for --------------------------

    def _recommend(self, obs: Observation, current: int) -> _Recommendation:
        cfg = self.config
        capacity = obs.capacity_per_worker_items_s()
        busy_load = obs.busy_ratio * obs.ready_workers
        if capacity is None:
            return self._recommend_unmeasured(obs, current, busy_load)
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
            return _Recommendation(self._clamp(need), why)
        keep = math.ceil(load / (cfg.target_busy_ratio * (1.0 - cfg.scale_down_margin)) - 1e-9)
        keep = max(keep, need)
        if keep < current:
            floor = cfg.target_busy_ratio * (1.0 - cfg.scale_down_margin)
            why = f"{source} is {load:.2f} workers of work; {keep} stay below busy ratio {floor:.2f}"
            return _Recommendation(self._clamp(keep), why)
        return _Recommendation(self._clamp(current), f"{why}; within the hysteresis band at {current}")

    def _recommend_unmeasured(self, obs: Observation, current: int, busy_load: float) -> _Recommendation:
        """No batch measured yet: grow on the busy ratio (or from zero on any work), never shrink."""
        need = math.ceil(busy_load / self.config.target_busy_ratio - 1e-9)
        if (obs.arrival_rate_items_s > 0 or obs.queue_depth_items > 0) and need < 1:
            need = 1
        if need > current:
            why = f"no batch measured yet; busy ratio {obs.busy_ratio:.2f} of {obs.ready_workers} workers"
            return _Recommendation(self._clamp(need), why)
        return _Recommendation(self._clamp(current), "no batch measured yet: holding (never shrink blind)")

    def _clamp(self, n: int) -> int:
        return min(self.config.max_workers, max(self.config.min_workers, n))

    # -- stabilize: windows, cooldowns, bounded step --------------------------------------------------

    def _remember(self, now: float, workers: int) -> None:
        self._history.append((now, workers))
        keep_s = max(self.config.scale_up_stabilization_s, self.config.scale_down_stabilization_s)
        while self._history and now - self._history[0][0] > keep_s:
            self._history.popleft()

    def _window(self, now: float, window_s: float) -> list[int]:
        return [w for t, w in self._history if now - t <= window_s]

    def _stabilize(self, now: float, observed_s: float, current: int, rec: _Recommendation) -> Decision:
        """`observed_s`: how long this policy has watched the fleet; a down-window not yet observed in
        full is not stable (a fresh policy never scales down on its first looks)."""
        cfg = self.config
        bounded = self._clamp(current)
        if bounded != current:
            return Decision(
                bounded, f"bring the fleet within [{cfg.min_workers}, {cfg.max_workers}]", current
            )
        up_to = min(self._window(now, cfg.scale_up_stabilization_s))
        down_to = max(self._window(now, cfg.scale_down_stabilization_s))
        if up_to > current:
            blocked = self._cooling(now, cfg.scale_up_cooldown_s)
            if blocked is not None:
                return Decision(current, f"scale up to {up_to} waits for the cooldown ({blocked})", current)
            target = min(up_to, current + cfg.max_step_up_workers)
            return Decision(target, f"scale up {current} -> {target}: {rec.why}", current)
        if down_to < current and observed_s >= cfg.scale_down_stabilization_s:
            blocked = self._cooling(now, cfg.scale_down_cooldown_s)
            if blocked is not None:
                return Decision(
                    current, f"scale down to {down_to} waits for the cooldown ({blocked})", current
                )
            return Decision(current - 1, f"scale down {current} -> {current - 1}: {rec.why}", current)
        if rec.workers != current:
            window = "up" if rec.workers > current else "down"
            return Decision(
                current, f"hold at {current}: {rec.workers} not yet stable over the {window} window", current
            )
        return Decision(current, f"hold at {current}: {rec.why}", current)

    def _cooling(self, now: float, cooldown_s: float) -> str | None:
        if self._last_change_at is None:
            return None
        left = self._last_change_at + cooldown_s - now
        if left <= 0:
            return None
        return f"{left:.1f} s of {cooldown_s:.0f} s left since the last change"

    def _record(self, now: float, decision: Decision) -> None:
        self._decisions += 1
        self._last_reason = decision.reason
        self._target = decision.target_workers
        if decision.action is Action.HOLD:
            return
        if decision.action is Action.UP:
            self._ups += 1
        else:
            self._downs += 1
        self._last_change_at = now
        self._changes.append(now)
        while self._changes and now - self._changes[0] > RATE_WINDOW_S:
            self._changes.popleft()


def _predicted_wait_s(depth: int, fleet_capacity_items_s: float) -> float:
    if depth <= 0:
        return 0.0
    if fleet_capacity_items_s <= 0.0:
        return math.inf
    return depth / fleet_capacity_items_s
