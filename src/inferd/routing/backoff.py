"""Capped exponential backoff: the one schedule for how long something waits after failing again.

Ejections (a slow or failing worker, a failing upstream engine) and worker restarts (a crash loop) all use
it. A plain value: the caller keeps the count of failures, the backoff only says how long that count
waits: `initial_s`, multiplied by `factor` for each failure after the first, at most `max_s`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    initial_s: float
    """The first wait."""
    max_s: float
    """No wait is longer."""
    factor: float = 2.0
    """Each further failure multiplies the wait by this."""

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, got {self.initial_s}, {self.max_s}")
        if self.factor < 1.0:
            raise ValueError(f"backoff factor must be >= 1, got {self.factor}")

    def delay_s(self, step: int) -> float:
        """The wait after `step` earlier failures in a row: `initial_s` for step 0 (and below), then
        `initial_s x factor**step`, capped at `max_s`."""
        delay = self.initial_s
        for _ in range(step):  # at most log(max/initial) rounds before the cap ends it
            delay *= self.factor
            if delay >= self.max_s:
                return self.max_s
        return delay
