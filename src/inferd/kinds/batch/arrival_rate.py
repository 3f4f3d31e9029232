"""The arrival rate the SLO batch policy plans with: a plain object fed with (now, items admitted so far) at
each decision; no clock of its own."""

from __future__ import annotations

import math


class ArrivalRate:
    """Arrivals per second: sum over arrivals of exp(-(now - t) / window_s) / window_s (an unbiased
    estimate of a steady rate, that follows a burst at once)."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.rate = 0.0
        self._total: int | None = None
        self._at = 0.0

    def update(self, now: float, total: int) -> float:
        if self._total is not None:
            decay = math.exp(-max(0.0, now - self._at) / self.window_s)
            self.rate = self.rate * decay + max(0, total - self._total) / self.window_s
        self._at, self._total = now, total
        return self.rate
