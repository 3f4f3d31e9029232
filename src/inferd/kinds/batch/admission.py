"""Admission: is there room, and can the request still meet its deadline? Plus an honest Retry-After.

A plain object fed with batch completions; estimates come from what was measured, never from config.
"""

from __future__ import annotations

import math

from inferd.errors import Overloaded, retry_after_s
from inferd.routing.fairness import INTERACTIVE


class DrainEstimator:
    """EWMA of batch latency and batch size, from which queue wait and drain time are predicted."""

    def __init__(self, max_batch_size: int, alpha: float = 0.2) -> None:
        self.max_batch_size = max_batch_size
        self.alpha = alpha
        self.batch_latency_s: float | None = None
        self._curve: dict[int, tuple[float, float]] = {}
        self.items_per_batch: float | None = None

    def curve(self) -> list[tuple[float, float]]:
        """Measured (mean batch size, EWMA latency) points, one per power-of-two size bucket."""
        return sorted(self._curve.values())

    def cost_line(self) -> tuple[float, float] | None:
        """(a, b) of the least-squares line cost(n) = a + b*n through the measured curve; None: not enough
        distinct batch sizes measured yet, or a line that makes no sense (negative slope or base)."""
        points = self.curve()
        if len(points) < 2:
            return None
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        if sxx <= 0:
            return None
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        intercept = my - slope * mx
        return (intercept, slope) if slope >= 0 and intercept > 0 else None

    def full_batch_latency_s(self) -> float | None:
        """Latency of a full batch from the cost line, so low load, which only shows small batches, does
        not hide the per-item cost."""
        line = self.cost_line()
        return None if line is None else line[0] + line[1] * self.max_batch_size

    def observe_batch(self, size: int, latency_s: float) -> None:
        bucket = 1 << max(0, size.bit_length() - 1)  # 1, 2, 4, ... the largest power of two <= size
        previous = self._curve.get(bucket)
        if previous is None:
            self._curve[bucket] = (float(size), latency_s)
        else:
            a = self.alpha
            self._curve[bucket] = (
                previous[0] + a * (size - previous[0]),
                previous[1] + a * (latency_s - previous[1]),
            )
        if self.batch_latency_s is None or self.items_per_batch is None:
            self.batch_latency_s, self.items_per_batch = latency_s, float(size)
            return
        a = self.alpha
        self.batch_latency_s += a * (latency_s - self.batch_latency_s)
        self.items_per_batch += a * (size - self.items_per_batch)

    def predicted_wait_s(self, queued: int, workers: int) -> float | None:
        """Time until an item joining behind `queued` items has its result: the batches ahead of it,
        shared by the workers, plus its own batch. None until a batch has been measured."""
        if self.batch_latency_s is None or workers <= 0:
            return None
        batches_ahead = math.ceil((queued + 1) / self.max_batch_size)
        return self.batch_latency_s * (batches_ahead / workers + 1.0)

    def drain_time_s(self, queued: int, workers: int) -> float:
        predicted = self.predicted_wait_s(queued, workers)
        return predicted if predicted is not None else 1.0


def check_admission(
    model: str,
    queued: int,
    capacity: int,
    n: int,
    now: float,
    deadline: float | None,
    estimator: DrainEstimator,
    workers: int,
    ahead: int | None = None,
) -> None:
    """Raise Overloaded if `n` more items do not fit, or cannot finish by `deadline`. `ahead`: the queued
    items that would run before these (default: all of them; SLO batching runs the lost ones after)."""
    if queued + n > capacity:
        drain = estimator.drain_time_s(queued, workers)
        raise Overloaded(
            f"model '{model}' queue is full ({queued}/{capacity} items queued, request needs {n}); "
            f"retry in {retry_after_s(drain)} s",
            retry_after_s=drain,
            reason="queue_full",
        )
    if deadline is None:
        return
    predicted = estimator.predicted_wait_s((queued if ahead is None else ahead) + n - 1, workers)
    if predicted is not None and now + predicted > deadline:
        budget_ms = max(0.0, (deadline - now) * 1000.0)
        raise Overloaded(
            f"model '{model}' cannot meet the deadline: predicted wait {predicted * 1000:.0f} ms "
            f"exceeds the remaining deadline of {budget_ms:.0f} ms ({queued} items queued)",
            retry_after_s=estimator.drain_time_s(queued, workers),
            reason="deadline",
        )


def check_loop_lag(lag_s: float, max_lag_s: float, priority: int) -> None:
    """The front end's CPU is saturated: refuse before reading the body (bulk first), or the excess
    would wait in socket buffers with unbounded latency instead of getting a 429."""
    if (lag_s > max_lag_s and priority != INTERACTIVE) or lag_s > 2 * max_lag_s:
        raise Overloaded(
            f"the front end is saturated (event loop {1000 * lag_s:.0f} ms behind); retry in 1 s",
            retry_after_s=1.0,
            reason="front_end_saturated",
        )
