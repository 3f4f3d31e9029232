"""Which worker takes the next batch: power of two choices on expected completion time, health first.

A plain object: no I/O, no clock, no randomness of its own (the caller passes a seeded `random.Random`).

* Each choice samples two distinct candidates, prefers the healthier one (`Health`: ready > probing), then the
  one whose batch would finish sooner: `(inflight + 1) x latency EWMA` of that worker. A worker whose latency is
  not known yet is assumed to be as fast as the fleet's median (or `prior_latency_s` when nothing is known).
* The load signal (batches in flight) comes with each choice, fresh from the caller, never cached here: the
  choice reflects the state just before dispatch. Only the latency EWMAs are remembered, by worker id.
* Candidates that are not routable (ejected, draining, dead) or that already hold `max_inflight` batches
  are never chosen, whatever the sample: the per-worker cap is hard.
* `statistics().equal_loads` counts the choices where both sampled workers looked the same: if it is close to
  `statistics().pairs`, the load signal is not telling the workers apart (STYLE, "Health and load").
"""

from __future__ import annotations

import math
import random
import statistics as stats
from collections.abc import Sequence
from dataclasses import dataclass

from inferd.routing.health import Health


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker as the caller sees it right now."""

    worker_id: str
    health: Health
    inflight: int
    """Batches sent and not answered yet (running + staged)."""


@dataclass(frozen=True, slots=True)
class BalancerStatistics:
    choices: int
    """Calls to `choose` that returned a worker."""
    pairs: int
    """Choices made between two sampled workers (the rest had a single eligible candidate)."""
    health_decided: int
    """Pairs decided by health alone."""
    equal_loads: int
    """Pairs of equal health whose expected completion times were equal: the load signal did not help."""
    no_candidate: int
    """Calls to `choose` with no eligible candidate (all over the cap or not routable)."""
    known_workers: int
    """Workers with a latency estimate."""


class P2CBalancer:
    def __init__(self, max_inflight: int = 2, ewma_alpha: float = 0.3, prior_latency_s: float = 0.05) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be within (0, 1], got {ewma_alpha}")
        if prior_latency_s <= 0:
            raise ValueError(f"prior_latency_s must be > 0, got {prior_latency_s}")
        self.max_inflight = max_inflight
        self.ewma_alpha = ewma_alpha
        self.prior_latency_s = prior_latency_s
        self._latency: dict[str, float] = {}
        self._choices = self._pairs = self._health_decided = self._equal = self._none = 0

    # ---- what the balancer learns ------------------------------------------------------------------
    def observe(self, worker_id: str, latency_s: float) -> None:
        """A batch of this worker took `latency_s` on the device."""
        latency_s = max(0.0, latency_s)
        old = self._latency.get(worker_id)
        self._latency[worker_id] = latency_s if old is None else old + self.ewma_alpha * (latency_s - old)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet, or its history no longer describes it (it came back from ejection)."""
        self._latency.pop(worker_id, None)

    def latency_s(self, worker_id: str) -> float:
        """The worker's latency EWMA; the fleet median (or the prior) while it has none."""
        known = self._latency.get(worker_id)
        if known is not None:
            return known
        return stats.median(self._latency.values()) if self._latency else self.prior_latency_s

    def expected_s(self, candidate: Candidate) -> float:
        """When a batch sent now would finish: behind everything the worker already holds."""
        return (candidate.inflight + 1) * self.latency_s(candidate.worker_id)

    # ---- the choice --------------------------------------------------------------------------------
    def eligible(self, candidate: Candidate) -> bool:
        return candidate.health in Health.ROUTABLE and candidate.inflight < self.max_inflight

    def choose(self, candidates: Sequence[Candidate], rng: random.Random) -> Candidate | None:
        """Two random eligible candidates, the healthier, then the sooner to finish. None: nobody may
        take a batch now."""
        pool = [c for c in candidates if self.eligible(c)]
        if not pool:
            self._none += 1
            return None
        self._choices += 1
        if len(pool) == 1:
            return pool[0]
        a, b = rng.sample(pool, 2)
        self._pairs += 1
        if a.health != b.health:
            self._health_decided += 1
            return a if a.health > b.health else b
        load_a, load_b = self.expected_s(a), self.expected_s(b)
        if math.isclose(load_a, load_b, rel_tol=1e-9, abs_tol=1e-12):
            self._equal += 1
            return a  # the sample order is already random
        return a if load_a < load_b else b

    def statistics(self) -> BalancerStatistics:
        return BalancerStatistics(
            self._choices, self._pairs, self._health_decided, self._equal, self._none, len(self._latency)
        )
