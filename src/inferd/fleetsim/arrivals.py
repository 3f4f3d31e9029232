"""Arrival processes for the simulator: intended request times in seconds from the start, as numpy
arrays (millions of arrivals are generated in one call).

- poisson: exponential gaps at `rate`;
- gamma: gamma-distributed gaps with mean 1/rate and coefficient of variation `cv` (cv 1 is Poisson,
  cv 3 is bursty);
- diurnal: a Poisson process whose rate follows rate * (1 + amplitude * sin(2 pi t / period_s)), by
  thinning;
- trace: a JSONL file of {"t": seconds} lines (other fields ignored), sorted.

The same seed gives the same arrivals. `inferd bench` draws its Poisson and gamma schedules the same way
(bench/open_loop.py arrival_offsets), which validation uses directly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inferd.bench.open_loop import exponential_gaps, gamma_gaps, renewal_times
from inferd.config import ConfigError

KINDS = ("poisson", "gamma", "diurnal", "trace")


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    kind: str = "poisson"
    rate: float = 100.0
    cv: float = 1.0
    amplitude: float = 0.5
    period_s: float = 60.0
    trace: Path | None = None
    seed: int = 0

    def check(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"arrivals must be one of {list(KINDS)}, got {self.kind!r}")
        if self.kind == "trace" and self.trace is None:
            raise ConfigError("trace arrivals need --trace FILE.jsonl")
        if self.kind != "trace" and self.rate <= 0:
            raise ConfigError(f"rate must be > 0, got {self.rate}")
        if self.kind == "gamma" and self.cv <= 0:
            raise ConfigError(f"cv must be > 0, got {self.cv}")
        if self.kind == "diurnal" and not (0 <= self.amplitude <= 1 and self.period_s > 0):
            raise ConfigError("diurnal arrivals need 0 <= amplitude <= 1 and period_s > 0")


def arrival_times(spec: ArrivalSpec, duration_s: float) -> np.ndarray:
    spec.check()
    rng = np.random.default_rng(spec.seed)
    if spec.kind == "trace":
        assert spec.trace is not None
        return _trace(spec.trace, duration_s)
    if spec.kind == "diurnal":
        peak = spec.rate * (1 + spec.amplitude)
        times = renewal_times(exponential_gaps(rng, peak), peak, duration_s)
        keep = rng.random(times.size) * peak <= spec.rate * (
            1 + spec.amplitude * np.sin(2 * math.pi * times / spec.period_s)
        )
        return times[keep]
    if spec.kind == "gamma":
        return renewal_times(gamma_gaps(rng, spec.rate, spec.cv), spec.rate, duration_s)
    return renewal_times(exponential_gaps(rng, spec.rate), spec.rate, duration_s)


def _trace(path: Path, duration_s: float) -> np.ndarray:
    times: list[float] = []
    try:
        with path.open() as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    times.append(float(json.loads(line)["t"]))
                except (ValueError, KeyError, TypeError):
                    raise ConfigError(
                        f"{path}:{number}: each line must be a JSON object with a number t"
                    ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the trace {path}: {exc}") from None
    out = np.sort(np.asarray(times, dtype=float))
    return out[(out >= 0) & (out < duration_s)]
