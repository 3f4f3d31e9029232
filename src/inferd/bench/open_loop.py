"""What the open-loop generators (`inferd bench`, `inferd bench-llm`) share: the arrival schedule, fixed
before the run (Poisson, gamma or constant arrivals), the wait for each intended send time, and the event loop
they run on.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any, Literal, Protocol, TypeVar

import numpy as np

Arrival = Literal["poisson", "constant", "gamma"]
ARRIVALS = ("poisson", "constant", "gamma")

MIN_SLEEP_S = 0.001
"""Shortest dispatcher sleep: loop timers tick in milliseconds, and uvloop turns a shorter sleep into a
busy spin. A request due sooner waits for the next tick (its lag, like all lag, counts in latency)."""

T = TypeVar("T")


class ArrivalPlan(Protocol):
    """What fixes a run's intended send times (`LoadSpec` and `LLMLoadSpec` both are one)."""

    @property
    def rate(self) -> float: ...

    @property
    def duration_s(self) -> float: ...

    @property
    def warmup_s(self) -> float: ...

    @property
    def arrival(self) -> Arrival: ...

    @property
    def arrival_cv(self) -> float:
        """gamma: the coefficient of variation of the gaps (1 is Poisson, 3 bursty)."""
        ...

    @property
    def seed(self) -> int: ...

    @property
    def max_requests(self) -> int: ...


def arrival_checks(plan: ArrivalPlan) -> dict[str, bool]:
    """The named checks a plan must pass (each message: True when it holds)."""
    return {
        "rate must be > 0": plan.rate > 0,
        "duration_s must be > 0": plan.duration_s > 0,
        "warmup_s must be >= 0": plan.warmup_s >= 0,
        "max_requests must be >= 1": plan.max_requests >= 1,
        "arrival must be 'poisson', 'constant' or 'gamma'": plan.arrival in ARRIVALS,
        "arrival_cv must be > 0": plan.arrival_cv > 0,
    }


def arrival_offsets(plan: ArrivalPlan) -> list[float]:
    """Intended send times in seconds from the start, over warmup + duration, at most max_requests."""
    total = plan.warmup_s + plan.duration_s
    if plan.arrival == "constant":
        n = min(plan.max_requests, math.ceil(total * plan.rate))
        return [i / plan.rate for i in range(n)]
    rng = np.random.default_rng(plan.seed)
    if plan.arrival == "gamma":
        gaps = gamma_gaps(rng, plan.rate, plan.arrival_cv)
    else:
        gaps = exponential_gaps(rng, plan.rate)
    return renewal_times(gaps, plan.rate, total, plan.max_requests).tolist()


Gaps = Callable[[int], np.ndarray]
"""n -> n gaps between arrivals, in seconds."""


def exponential_gaps(rng: np.random.Generator, rate: float) -> Gaps:
    """Poisson arrivals at `rate`."""
    return lambda n: rng.exponential(1.0 / rate, n)


def gamma_gaps(rng: np.random.Generator, rate: float, cv: float) -> Gaps:
    """Gamma-distributed gaps with mean 1 / rate and coefficient of variation `cv` (cv 3: bursty)."""
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    return lambda n: rng.gamma(shape, scale, n)


def renewal_times(gaps: Gaps, rate: float, total_s: float, max_n: int | None = None) -> np.ndarray:
    """Arrival times in [0, total_s) from successive gaps (at most `max_n`), drawn in chunks; the same
    gaps give the same times (`inferd bench` and the fleet simulator share this)."""
    expected = total_s * rate
    chunk = int(expected + 6 * math.sqrt(expected) + 16)
    limit = max_n if max_n is not None else math.inf
    times = np.cumsum(gaps(chunk))
    while times[-1] < total_s and times.size < limit:
        times = np.concatenate((times, times[-1] + np.cumsum(gaps(chunk))))
    times = times[times < total_s]
    return times if max_n is None else times[:max_n]


async def sleep_until(t: float, now: Callable[[], float]) -> None:
    """Return once `now()` has reached `t`: a loop timer may fire early, so check and sleep again."""
    while (delay := t - now()) > 0:  # noqa: ASYNC110 -- a timer may fire early
        await asyncio.sleep(delay if delay > MIN_SLEEP_S else MIN_SLEEP_S)


def run_blocking(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on a fresh event loop: uvloop when installed, else asyncio's default."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(main)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
