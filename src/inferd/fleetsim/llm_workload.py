"""An LLM workload for the simulator: arrival times and each request's prompt and output lengths
(fixed, or uniform over LOW..HIGH, as `inferd bench-llm` draws them)."""

from __future__ import annotations

import numpy as np

from inferd.bench.llm_workload import LengthDist
from inferd.fleetsim.arrivals import ArrivalSpec, arrival_times


def lengths(dist: LengthDist, n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(dist.low, dist.high + 1, size=n)


def workload(
    arrivals: ArrivalSpec, duration_s: float, prompt: LengthDist, output: LengthDist
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival times, prompt lengths, output lengths), seeded by the arrivals' seed."""
    times = arrival_times(arrivals, duration_s)
    rng = np.random.default_rng([arrivals.seed, 1])
    return times, lengths(prompt, times.size, rng), lengths(output, times.size, rng)
