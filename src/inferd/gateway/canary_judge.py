"""`CanaryJudge`: is the canary worse than the baseline? A plain policy on an injected clock, no I/O.

It is fed each outcome of the canary version and of the baseline (the default version): ok or error,
and the latency. `verdict()` compares, over a short and a long window, the canary's error ratio and p99
latency with the absolute bounds of `Rollback` and with the baseline's over the same window. A signal
breaches a window when the canary is over the bound AND worse than the baseline there (a baseline that
fails just as much means the trouble is not the canary's). Rollback needs the same signal to breach
both windows (multiwindow burn: the short window makes it fast, the long one keeps a blip from
firing), and at least `min_requests` canary outcomes in each window (never a verdict on a handful).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from inferd.clock import Clock
from inferd.config.traffic import Rollback

ERROR_OUTCOMES = frozenset({"model_error", "internal", "unavailable", "worker_died", "deadline"})
"""Outcomes (api/errors.py labels) that count against a version: it failed or could not answer in time.
Client errors, refusals under load (429) and cancelled calls say nothing about the version."""

MAX_SAMPLES = 20_000
"""Outcomes kept per side (a look sorts at most this many latencies, a few ms, once a second); at rates
where the long window holds more, it covers the newest ones."""


@dataclass(frozen=True, slots=True)
class WindowStats:
    requests: int
    errors: int
    p99_ms: float

    @property
    def error_ratio(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(frozen=True, slots=True)
class Breach:
    """Why the canary must go: the signal, and both windows' canary and baseline figures."""

    signal: str
    """"error_ratio" or "p99_ms"."""
    canary: tuple[WindowStats, WindowStats]
    """(short, long) windows."""
    baseline: tuple[WindowStats, WindowStats]
    bound: float

    @property
    def reason(self) -> str:
        (cs, cl), (bs, bl) = self.canary, self.baseline
        if self.signal == "error_ratio":
            return (
                f"canary error ratio {cs.error_ratio:.3f} (short window, {cs.requests} requests) and "
                f"{cl.error_ratio:.3f} (long window, {cl.requests}) over the bound {self.bound:g} and the "
                f"baseline's {bs.error_ratio:.3f} / {bl.error_ratio:.3f}"
            )
        return (
            f"canary p99 {cs.p99_ms:.1f} ms (short window, {cs.requests} requests) and {cl.p99_ms:.1f} ms "
            f"(long window, {cl.requests}) over the bound {self.bound:g} ms and the baseline's "
            f"{bs.p99_ms:.1f} / {bl.p99_ms:.1f} ms"
        )


class _Outcomes:
    """One side's outcomes, oldest first, trimmed to the long window."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, bool, float]] = deque(maxlen=MAX_SAMPLES)

    def add(self, at: float, error: bool, latency_s: float) -> None:
        self.samples.append((at, error, latency_s))

    def trim(self, since: float) -> None:
        while self.samples and self.samples[0][0] < since:
            self.samples.popleft()

    def window(self, since: float, p99: bool) -> WindowStats:
        """The outcomes since `since`; the p99 only when asked (it sorts them)."""
        inside = [(err, lat) for at, err, lat in self.samples if at >= since]
        errors = sum(1 for err, _ in inside if err)
        p99_ms = _p99([lat for _, lat in inside]) * 1000.0 if p99 else 0.0
        return WindowStats(len(inside), errors, p99_ms)


def _p99(latencies: list[float]) -> float:
    if not latencies:
        return 0.0
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class CanaryJudge:
    def __init__(self, rollback: Rollback, clock: Clock) -> None:
        self.rollback = rollback
        self.clock = clock
        self._canary = _Outcomes()
        self._baseline = _Outcomes()

    def record(self, canary: bool, outcome: str, latency_s: float) -> None:
        """One finished call of the canary (True) or of the baseline version."""
        side = self._canary if canary else self._baseline
        side.add(self.clock.now(), outcome in ERROR_OUTCOMES, latency_s)

    def verdict(self) -> Breach | None:
        """A breach when one signal breaches both windows with enough canary requests; else None."""
        r = self.rollback
        now = self.clock.now()
        long_since = now - max(r.long_window_s, r.short_window_s)
        self._canary.trim(long_since)
        self._baseline.trim(long_since)
        starts = (now - r.short_window_s, now - r.long_window_s)
        p99 = r.max_p99_ms is not None
        canary = (self._canary.window(starts[0], p99), self._canary.window(starts[1], p99))
        if any(w.requests < r.min_requests for w in canary):
            return None
        baseline = (self._baseline.window(starts[0], p99), self._baseline.window(starts[1], p99))
        if r.max_error_ratio is not None and all(
            c.error_ratio > r.max_error_ratio and c.error_ratio > b.error_ratio
            for c, b in zip(canary, baseline, strict=True)
        ):
            return Breach("error_ratio", canary, baseline, r.max_error_ratio)
        if r.max_p99_ms is not None and all(
            c.p99_ms > r.max_p99_ms and c.p99_ms > b.p99_ms for c, b in zip(canary, baseline, strict=True)
        ):
            return Breach("p99_ms", canary, baseline, r.max_p99_ms)
        return None
