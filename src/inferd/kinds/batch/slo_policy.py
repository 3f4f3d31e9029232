"""SLO-driven batching: the batch size, the wait and which items go first, chosen online from the model's
latency SLO, the measured cost line and the arrival rate, instead of a hand-tuned max_batch_size /
max_wait_ms. A plain object like BatchPolicy (same `decide`), no I/O, no clock of its own; it reads the
cost line, the count of admitted items and the queued items' enqueue times through the callables it is
given.

A model opts in with `batching = "slo"` and an [slo] table with `latency_ms`. `max_batch_size` stays the
device's hard limit; `max_wait_ms` only governs the first batches, before the cost line is measured.

The rule (a batch's items all finish together, so each meets the SLO iff the batch ends within the
budget of its enqueue time):

* budget B = latency_ms x (1 - slack), slack = 0.01 + 0.005 per nine of latency_target (0.02 at 0.99):
  the part of the SLO this policy cannot see (HTTP, the reply, jitter around the line). It is kept small
  on purpose: an item the policy counts as lost waits behind all the others, so a wide margin gives up
  items that would have made it.
* cost(n) = a + b n, the least-squares line through measured batch latencies (DrainEstimator.cost_line).
* which items, how many (`plan`): a batch of n items started at s meets the budget for the items enqueued
  at or after s + cost(n) - B. The batch is the oldest n of those, for the largest n for which there are
  at least n of them (at most max_batch_size). Under a burst this gives up the items that could only be
  saved by a batch too small to also carry the many behind them; at a steady rate it is the size at
  which a batch's run and the wait of the items arriving meanwhile just fit the budget.
* lost items (enqueued before s + cost(1) - B: not even a batch of their own would meet the budget) go
  after every item that can still meet it: they are cut, oldest first up to the SLO size (the largest n
  with cost(n) <= B), only when a worker is free and no other item is queued. Each still gets its one
  answer: its result, or DeadlineExceeded at its own request deadline.
* wait (a worker free, every item that can meet the budget fits in the batch): the batch is cut at
      min(oldest_at + a / 2, the latest t with (t - oldest_at) + cost(n + r (t - now)) <= B),
  oldest_at the batch's oldest item and r the arrival rate: a free device waits for company at most half
  a base cost, and never past the point where the batch, grown by the expected arrivals, would miss the
  budget. Every arrival re-decides, so a burst cuts at once.
* staging (no free worker, a free staging slot): only a batch that waiting cannot grow (more items
  could meet the budget than it takes, or it is at the device's limit), planned for the end of the
  running batch, at `stage_at`; otherwise it keeps filling until a worker frees.
* before the cost line is measured (fewer than two batch-size buckets seen): the fixed BatchPolicy with
  the configured max_batch_size and max_wait_ms, FIFO.

The arrival rate r is an exponentially decaying count of admitted items with a time constant of one
latency_ms (kinds/batch/arrival_rate.py).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from inferd.config import ModelConfig
from inferd.kinds.batch.admission import DrainEstimator
from inferd.kinds.batch.arrival_rate import ArrivalRate
from inferd.kinds.batch.policy import NOTHING, STAGE_LEAD_MIN_S, BatchPolicy, CutDecision, CutPolicy
from inferd.observability.slo_config import SloConfig

CostLine = tuple[float, float]

BASE_SLACK = 0.01
"""Share of latency_ms always left to what the policy cannot see ..."""
SLACK_PER_NINE = 0.005
"""... plus this much per nine of latency_target (a stricter target leaves more room for jitter)."""
TIME_TOLERANCE_S = 1e-6
"""A batch due within this much of now is cut now."""
WAIT_BASE_FRACTION = 0.5
"""An idle worker waits for company at most this share of the batch's base cost a (from its oldest item)."""


def budget_s(slo: SloConfig) -> float:
    """The latency, queue wait plus batch run, the policy plans every batch to stay within."""
    nines = -math.log10(1.0 - slo.latency_target)
    return slo.latency_ms / 1000.0 * (1.0 - min(0.5, BASE_SLACK + SLACK_PER_NINE * nines))


@dataclass(frozen=True, slots=True)
class SloBatchStatistics:
    budget_s: float
    rate_per_s: float
    cost_line: CostLine | None
    """None: not measured yet (the fixed fallback decides)."""
    slo_size: int | None
    """The largest batch whose run fits the budget (None: no cost line yet)."""
    late_batches: int
    """Batches of items that could no longer meet the SLO, cut when nothing that still could was queued."""


@dataclass(frozen=True, slots=True)
class OnTimePlan:
    """The batch that puts the most queued items within the budget, if it started at `start`."""

    size: int
    since: float
    """The batch is the `size` oldest items enqueued at or after this (they all finish within budget)."""
    oldest_at: float
    """The oldest of them."""
    candidates: int
    """Items that could still meet the budget alone: when more than `size`, the batch is bounded by time
    (waiting cannot grow it), else by the items there are."""


class SloBatchPolicy:
    def __init__(
        self,
        slo: SloConfig,
        max_batch_size: int,
        fallback: BatchPolicy,
        cost_line: Callable[[], CostLine | None],
        arrived: Callable[[], int],
        queued_times: Callable[[float], list[float]],
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.budget_s = budget_s(slo)
        self.fallback = fallback
        self._cost_line = cost_line
        self._arrived = arrived
        self._queued_times = queued_times
        self.arrivals = ArrivalRate(slo.latency_ms / 1000.0)
        self.late_batches = 0
        self.shed = slo.shed_lost
        self._promised: tuple[float, float] | None = None
        """(oldest_at, due_at) of the wake-up last asked for: at it that batch is cut."""

    def decide(
        self,
        now: float,
        queued: int,
        oldest_at: float | None,
        idle_workers: int,
        stage_slots: int,
        stage_at: float | None = None,
    ) -> CutDecision:
        """As BatchPolicy.decide; sizes, waits and which items from the SLO (module docstring)."""
        rate = self.arrivals.update(now, self._arrived())
        line = self._cost_line()
        if line is None:
            return self.fallback.decide(now, queued, oldest_at, idle_workers, stage_slots, stage_at)
        if queued <= 0 or oldest_at is None:
            return NOTHING
        if idle_workers > 0:
            return self._for_idle(now, queued, line, rate)
        if stage_slots > 0:
            return self._for_staging(now, line, stage_at)
        return NOTHING

    def lost_before(self, now: float) -> float | None:
        """With shed_lost: items enqueued before this miss the budget even alone in a batch started now."""
        line = self._cost_line() if self.shed else None
        return None if line is None else now + line[0] + line[1] - self.budget_s

    def slo_size(self, line: CostLine) -> int:
        """The largest n <= max_batch_size with cost(n) <= budget (at least 1)."""
        return self._fits(line, self.budget_s)

    def _fits(self, line: CostLine, limit_s: float) -> int:
        """The largest n <= max_batch_size with cost(n) <= limit_s (at least 1)."""
        base, per_item = line
        room = limit_s - base
        if room <= per_item:
            return 1
        if room >= per_item * self.max_batch_size:
            return self.max_batch_size
        return max(1, int(room / per_item))

    def plan(self, start: float, line: CostLine) -> OnTimePlan | None:
        """The largest n with at least n queued items enqueued at or after start + cost(n) - budget (so a
        batch of the oldest n of them, started at `start`, has all its items within the budget); None
        when no item can meet the budget any more."""
        base, per_item = line
        times = self._queued_times(start + base + per_item - self.budget_s)
        if not times:
            return None
        count = len(times)

        def on_time(n: int) -> int:
            return count - bisect.bisect_left(times, start + base + per_item * n - self.budget_s)

        lo, hi = 1, min(count, self.max_batch_size)  # on_time(1) == count >= 1; on_time(n) - n falls
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if on_time(mid) >= mid:
                lo = mid
            else:
                hi = mid - 1
        since = start + base + per_item * lo - self.budget_s
        return OnTimePlan(lo, since, times[count - on_time(lo)], count)

    def _for_idle(self, now: float, queued: int, line: CostLine, rate: float) -> CutDecision:
        plan = self.plan(now, line)
        if plan is None:  # only lost items are queued: the oldest, up to the SLO size
            self.late_batches += 1
            return CutDecision(min(queued, self.slo_size(line)))
        if plan.size < plan.candidates or plan.size == self.max_batch_size:
            return CutDecision(plan.size, since=plan.since)
        oldest_at = plan.oldest_at
        due_at = min(
            self.due_at(now, plan.size, oldest_at, line, rate), oldest_at + WAIT_BASE_FRACTION * line[0]
        )
        if self._promised is not None and self._promised[0] == oldest_at:
            due_at = min(due_at, self._promised[1])  # a wake-up asked for cuts, whatever the rate did since
        if now >= due_at - TIME_TOLERANCE_S:
            self._promised = None
            return CutDecision(plan.size, since=plan.since)
        self._promised = (oldest_at, due_at)
        return CutDecision(0, wake_at=due_at)

    def due_at(self, now: float, queued: int, oldest_at: float, line: CostLine, rate: float) -> float:
        """The latest t with (t - oldest_at) + cost(queued + rate (t - now)) <= budget."""
        base, per_item = line
        slope = 1.0 + per_item * rate
        return (self.budget_s + oldest_at - base - per_item * queued + per_item * rate * now) / slope

    def _for_staging(self, now: float, line: CostLine, stage_at: float | None) -> CutDecision:
        starts_at = max(now, stage_at if stage_at is not None else now) + STAGE_LEAD_MIN_S
        plan = self.plan(starts_at, line)
        if plan is None or (plan.size == plan.candidates and plan.size < self.max_batch_size):
            return NOTHING  # lost items only, or a batch that may still grow: cut when the worker frees
        if stage_at is not None and now < stage_at:
            return CutDecision(0, wake_at=stage_at)
        return CutDecision(plan.size, idle=False, since=plan.since)

    def statistics(self) -> SloBatchStatistics:
        line = self._cost_line()
        size = None if line is None else self.slo_size(line)
        return SloBatchStatistics(self.budget_s, self.arrivals.rate, line, size, self.late_batches)


def batch_policy(
    config: ModelConfig,
    estimator: DrainEstimator,
    arrived: Callable[[], int],
    queued_times: Callable[[float], list[float]],
) -> CutPolicy:
    """The model's batch policy: the fixed one, or (`batching = "slo"`) the SLO-driven one, which falls back
    to the fixed one until `estimator` has measured the cost line. `arrived`: items admitted so far;
    `queued_times(since)`: when the queued items a cut with `since` chooses from were enqueued, oldest
    first (RequestQueue.times_since)."""
    fixed = BatchPolicy(config.max_batch_size, config.max_wait_s, config.preferred_batch_sizes)
    if config.batching != "slo" or config.slo is None:
        return fixed
    return SloBatchPolicy(
        config.slo, config.max_batch_size, fixed, estimator.cost_line, arrived, queued_times
    )


def queued_ahead(config: ModelConfig, count_since: Callable[[float], int]) -> Callable[[float], int] | None:
    """For admission's deadline check: how many queued items a new one would wait behind at `now`. SLO
    batching serves the items that can still meet the SLO (enqueued within its budget) before the lost
    ones, so only those count; None for the fixed policy (every queued item is ahead, FIFO)."""
    if config.batching != "slo" or config.slo is None:
        return None
    budget = budget_s(config.slo)
    return lambda now: count_since(now - budget)
