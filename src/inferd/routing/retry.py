"""A retry budget, Finagle/Envoy style: retries may add at most `ratio` of recent requests, plus a small
floor per second, so a crash loop cannot multiply load.

Written here rather than taken from a library: stamina and tenacity retry single calls with backoff but
have no shared budget (see shared/PROTOCOLS.md, "Retries"). A plain object with an injected clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inferd.clock import Clock


@dataclass(frozen=True, slots=True)
class BudgetStatistics:
    balance: float
    requests_in_window: int
    retries_in_window: int
    exhausted_total: int


class RetryBudget:
    def __init__(
        self, clock: Clock, ratio: float = 0.2, min_per_s: float = 10.0, window_s: float = 10.0
    ) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"retry ratio must be within [0, 1], got {ratio}")
        if min_per_s < 0 or window_s <= 0:
            raise ValueError(f"min_per_s must be >= 0 and window_s > 0, got {min_per_s}, {window_s}")
        self.clock = clock
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.window_s = window_s
        self._requests: deque[list[float]] = deque()
        self._retries: deque[list[float]] = deque()
        self._n_requests = 0
        self._n_retries = 0
        self.exhausted_total = 0

    def record_requests(self, n: int = 1) -> None:
        self._add(self._requests, n)
        self._n_requests += n

    def balance(self) -> float:
        self._expire(self.clock.now())
        return self.min_per_s * self.window_s + self.ratio * self._n_requests - self._n_retries

    def try_spend(self, n: int = 1) -> bool:
        """Take `n` retries from the budget, all or nothing."""
        if self.balance() < n:
            self.exhausted_total += 1
            return False
        self._add(self._retries, n)
        self._n_retries += n
        return True

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(self.balance(), self._n_requests, self._n_retries, self.exhausted_total)

    def _add(self, counts: deque[list[float]], n: int) -> None:
        """Counts go in 1-second buckets, so memory stays bounded by the window, whatever the rate."""
        now = self.clock.now()
        bucket = float(int(now))
        if counts and counts[-1][0] == bucket:
            counts[-1][1] += n
        else:
            counts.append([bucket, n])
            self._expire(now)

    def _expire(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._requests and self._requests[0][0] + 1.0 <= cutoff:
            self._n_requests -= int(self._requests.popleft()[1])
        while self._retries and self._retries[0][0] + 1.0 <= cutoff:
            self._n_retries -= int(self._retries.popleft()[1])
