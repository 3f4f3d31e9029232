"""SLO-driven batching: the batch size and the wait chosen online from the model's latency SLO, the measured
cost line and the arrival rate, instead of a hand-tuned max_batch_size / max_wait_ms. A plain object like
BatchPolicy (same `decide`), no I/O, no clock of its own; it reads the cost line and the count of admitted
items through the callables it is given.

A model opts in with `batching = "slo"` and an [slo] table with `latency_ms`. `max_batch_size` stays the
device's hard limit; `max_wait_ms` only governs the first batches, before the cost line is measured.

The rule (batches are cut FIFO, so a batch's oldest item is the one that decides whether it meets the SLO):

* budget = latency_ms x (1 - slack), slack = 0.1 + 0.05 per nine of latency_target (0.2 at 0.99): the
  part of the SLO this policy cannot see (HTTP, the reply, the event loop, jitter around the line).
* cost(n) = a + b n, the least-squares line through measured batch latencies (DrainEstimator.cost_line).
* size: the SLO size is the largest n <= max_batch_size with cost(n) <= budget, the biggest batch whose own
  run leaves its items within the SLO. A free worker takes everything queued up to that size: under a
  burst batches grow with the backlog by themselves, and a small batch is never cut to spare an old head
  (that splits a backlog into more batches, each paying a again, and costs more items than it saves).
* drain: when the oldest item cannot meet the SLO any more even alone (age + cost(1) > budget) and more
  than the SLO size is queued, the burst outran the device: the batch takes the device's limit
  (max_batch_size), so the lost backlog clears at the best rate and the arrivals behind it are on time
  sooner.
* wait (a worker free, fewer items than the SLO size): the batch is cut at
      min(oldest_at + a / 2, the latest t with (t - oldest_at) + cost(queued + r (t - now)) <= budget),
  r the arrival rate: a free device waits for company at most half a base cost (waiting longer saves
  less than it costs), and never past the point where the batch, grown by the expected arrivals, would
  miss the budget. Every arrival re-decides, so a burst cuts at once.
* staging (no free worker, a free staging slot): only a batch of the SLO size (or a drain), at
  `stage_at`, sized as of the end of the running batch; a smaller one keeps filling until a worker frees.
* before the cost line is measured (fewer than two batch-size buckets seen): the fixed BatchPolicy with
  the configured max_batch_size and max_wait_ms.

The arrival rate r is an exponentially decaying count of admitted items with a time constant of one
latency_ms (batching/arrival_rate.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from inferd.batching.admission import DrainEstimator
from inferd.batching.arrival_rate import ArrivalRate
from inferd.batching.policy import NOTHING, STAGE_LEAD_MIN_S, BatchPolicy, CutDecision, CutPolicy
from inferd.config import ModelConfig
from inferd.observability.slo_config import SloConfig

CostLine = tuple[float, float]

BASE_SLACK = 0.1
"""Share of latency_ms always left to what the policy cannot see ..."""
SLACK_PER_NINE = 0.05
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
    drained: int
    """Batches cut at the device's limit because a burst's backlog could not meet the SLO any more."""


class SloBatchPolicy:
    def __init__(
        self,
        slo: SloConfig,
        max_batch_size: int,
        fallback: BatchPolicy,
        cost_line: Callable[[], CostLine | None],
        arrived: Callable[[], int],
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.budget_s = budget_s(slo)
        self.fallback = fallback
        self._cost_line = cost_line
        self._arrived = arrived
        self.arrivals = ArrivalRate(slo.latency_ms / 1000.0)
        self.drained = 0
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
        """As BatchPolicy.decide; sizes and waits from the SLO (module docstring)."""
        rate = self.arrivals.update(now, self._arrived())
        line = self._cost_line()
        if line is None:
            return self.fallback.decide(now, queued, oldest_at, idle_workers, stage_slots, stage_at)
        if queued <= 0 or oldest_at is None:
            return NOTHING
        if idle_workers > 0:
            return self._for_idle(now, queued, oldest_at, line, rate)
        if stage_slots > 0:
            return self._for_staging(now, queued, oldest_at, line, stage_at)
        return NOTHING

    def slo_size(self, line: CostLine) -> int:
        """The largest n <= max_batch_size with cost(n) <= budget (at least 1)."""
        base, per_item = line
        room = self.budget_s - base
        if room <= per_item:
            return 1
        if room >= per_item * self.max_batch_size:
            return self.max_batch_size
        return max(1, int(room / per_item))

    def size_for(self, start: float, queued: int, oldest_at: float, line: CostLine) -> tuple[int, bool]:
        """(the size of a batch starting at `start`, whether it drains a lost backlog)."""
        size = self.slo_size(line)
        lost = start - oldest_at + line[0] + line[1] > self.budget_s
        if lost and queued > size:
            return min(queued, self.max_batch_size), True
        return min(queued, size), False

    def _for_idle(
        self, now: float, queued: int, oldest_at: float, line: CostLine, rate: float
    ) -> CutDecision:
        size, drain = self.size_for(now, queued, oldest_at, line)
        if drain:
            self.drained += 1
            return CutDecision(size)
        if size < queued or size == self.slo_size(line):
            return CutDecision(size)
        due_at = min(
            self.due_at(now, queued, oldest_at, line, rate), oldest_at + WAIT_BASE_FRACTION * line[0]
        )
        if self._promised is not None and self._promised[0] == oldest_at:
            due_at = min(due_at, self._promised[1])  # a wake-up asked for cuts, whatever the rate did since
        if now >= due_at - TIME_TOLERANCE_S:
            self._promised = None
            return CutDecision(queued)
        self._promised = (oldest_at, due_at)
        return CutDecision(0, wake_at=due_at)

    def due_at(self, now: float, queued: int, oldest_at: float, line: CostLine, rate: float) -> float:
        """The latest t with (t - oldest_at) + cost(queued + rate (t - now)) <= budget."""
        base, per_item = line
        slope = 1.0 + per_item * rate
        return (self.budget_s + oldest_at - base - per_item * queued + per_item * rate * now) / slope

    def _for_staging(
        self, now: float, queued: int, oldest_at: float, line: CostLine, stage_at: float | None
    ) -> CutDecision:
        starts_at = max(now, stage_at if stage_at is not None else now) + STAGE_LEAD_MIN_S
        size, drain = self.size_for(starts_at, queued, oldest_at, line)
        if not drain and size < self.slo_size(line):
            return NOTHING
        if stage_at is not None and now < stage_at:
            return CutDecision(0, wake_at=stage_at)
        if drain:
            self.drained += 1
        return CutDecision(size, idle=False)

    def statistics(self) -> SloBatchStatistics:
        line = self._cost_line()
        size = None if line is None else self.slo_size(line)
        return SloBatchStatistics(self.budget_s, self.arrivals.rate, line, size, self.drained)


def batch_policy(config: ModelConfig, estimator: DrainEstimator, arrived: Callable[[], int]) -> CutPolicy:
    """The model's batch policy: the fixed one, or (`batching = "slo"`) the SLO-driven one, which falls back
    to the fixed one until `estimator` has measured the cost line. `arrived`: items admitted so far."""
    fixed = BatchPolicy(config.max_batch_size, config.max_wait_s, config.preferred_batch_sizes)
    if config.batching != "slo" or config.slo is None:
        return fixed
    return SloBatchPolicy(config.slo, config.max_batch_size, fixed, estimator.cost_line, arrived)
