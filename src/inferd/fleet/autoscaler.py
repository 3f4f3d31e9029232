"""How many workers a model should have: a batching-aware scaling policy (ROADMAP Part 2, RELIABILITY F8).

A plain object with an injected clock and no I/O. The driver (fleet/scaling.py) feeds it one observation
per tick, and its model kind's demand (`Kind.autoscaling`, runtime/demand.py) says what that observation
alone asks for; this class damps it and hands the `Decision` to the launcher. The decision only says
*how many* workers; which worker goes and how (drain first, then stop: zero failed in-flight requests)
is the launcher's job, as is replacing a worker that died while the target did not change.

A batch model's signals (kinds/batch/demand.py) are batching-aware; an LLM model's are its engines'
pressure (kinds/llm/demand.py). For batch, a worker's capacity is what it completes at full batches
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
[min_workers, max_workers]. A scale-up from zero workers (`min_workers = 0`) is not damped by the
up-window or the cooldowns: requests are waiting for a worker (kinds/batch/cold.py holds them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from inferd.clock import Clock
from inferd.config.autoscaler import AutoscalerConfig
from inferd.runtime.demand import Demand, Observed, Recommendation

RATE_WINDOW_S = 60.0
"""The window of `AutoscalerStats.changes_last_minute`."""


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


class Autoscaler:
    """Feed `decide(observation)` once per tick; it returns the target fleet size and why."""

    def __init__(self, config: AutoscalerConfig, clock: Clock, demand: Demand) -> None:
        self.config = config
        self.clock = clock
        self.demand = demand
        """What the latest observation alone asks for (the model kind's signals: `Kind.autoscaling`);
        damping is this class's."""
        self._target: int | None = None
        self._first_seen_at: float | None = None
        self._history: deque[tuple[float, int]] = deque()
        self._last_change_at: float | None = None
        self._changes: deque[float] = deque()
        self._decisions = 0
        self._ups = 0
        self._downs = 0
        self._last_reason: str | None = None

    def decide(self, obs: Observed) -> Decision:
        now = self.clock.now()
        if self._first_seen_at is None:
            self._first_seen_at = now
        current = self._target if self._target is not None else obs.ready_workers + obs.starting_workers
        rec = self.demand.recommend(obs, current, self._clamp)
        self._remember(now, rec.workers)
        decision = self._stabilize(now, now - self._first_seen_at, current, rec)
        self._record(now, decision)
        return decision

    @property
    def target_workers(self) -> int | None:
        """The latest decision's target (None before the first)."""
        return self._target

    def fleet_gone(self) -> None:
        """The fleet went to zero beneath the latest target (an operator scaled it to 0): the next decision
        counts the workers it observes, as the first one does (a `min_workers = 0` model wakes again)."""
        self._target = None

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

    def _stabilize(self, now: float, observed_s: float, current: int, rec: Recommendation) -> Decision:
        """`observed_s`: how long this policy has watched the fleet; a down-window not yet observed in
        full is not stable (a fresh policy never scales down on its first looks)."""
        cfg = self.config
        bounded = self._clamp(current)
        if bounded != current:
            return Decision(
                bounded, f"bring the fleet within [{cfg.min_workers}, {cfg.max_workers}]", current
            )
        if current == 0 and rec.workers > 0:  # requests wait for a worker (kinds/batch/cold.py): no damping
            target = min(rec.workers, cfg.max_step_up_workers)
            return Decision(target, f"scale up from zero to {target} (no window nor cooldown): {rec.why}", current)
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
