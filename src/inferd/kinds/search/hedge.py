"""When a shard request is hedged to another replica. A plain object with an injected clock, no I/O.

A shard's request that has not answered after the shard's observed p95 latency is sent to a second
replica too (the first answer wins; searches are read-only, so a copy is harmless). Hedges spend a
budget that every first request tops up by `ratio` (5%): at most that share of extra shard requests,
plus a small burst, whatever the latencies do. Until a shard has `min_samples` latencies it hedges after
`initial_delay_s`. A first request the chooser made a probe of a slow replica (kinds/search/replicas.py) is
hedged at once and may spend the last token: other hedges leave `probe_reserve` tokens for probes, so no
search waits on a slow replica while the budget lasts. (kinds/batch/hedging.py decides on whole batches from
a fleet cost line and spends the shared retry budget; a shard request is one read, so this smaller rule
fits it better.)
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from inferd.clock import Clock


@dataclass(frozen=True, slots=True)
class HedgeStatistics:
    requests: int
    hedges: int
    denied: int
    """Hedges the budget refused."""
    tokens: float
    p95_s: tuple[float | None, ...]
    """Each shard's observed p95 (None: too few samples yet)."""


class HedgePolicy:
    def __init__(
        self,
        clock: Clock,
        shards: int,
        ratio: float = 0.05,
        burst: float = 5.0,
        window: int = 256,
        min_samples: int = 20,
        initial_delay_s: float = 0.05,
        min_delay_s: float = 0.002,
        probe_reserve: float = 1.0,
    ) -> None:
        self.clock = clock
        self.ratio = ratio
        self.burst = burst
        self.min_samples = min_samples
        self.initial_delay_s = initial_delay_s
        self.min_delay_s = min_delay_s
        self.probe_reserve = probe_reserve
        self._latencies = [deque[float](maxlen=window) for _ in range(shards)]
        self._sorted: list[list[float]] = [[] for _ in range(shards)]
        """The same window kept in order (bisect per sample, not a sort per p95: a sort of 256 floats
        per shard call was ~8% of the front end's CPU per search)."""
        self._tokens = 1.0 + probe_reserve
        self.requests = self.hedges = self.denied = 0

    def started(self) -> None:
        """A first request to a shard went out: it earns `ratio` of a hedge."""
        self.requests += 1
        self._tokens = min(self.burst, self._tokens + self.ratio)

    def observe(self, shard: int, latency_s: float) -> None:
        window, ordered = self._latencies[shard], self._sorted[shard]
        if len(window) == window.maxlen:
            del ordered[bisect.bisect_left(ordered, window[0])]
        window.append(latency_s)
        bisect.insort(ordered, latency_s)

    def _p95(self, shard: int) -> float | None:
        samples = self._sorted[shard]
        return samples[int(0.95 * (len(samples) - 1))] if len(samples) >= self.min_samples else None

    def delay_s(self, shard: int, probe: bool = False) -> float:
        """How long the first request may run before a hedge is worth sending: none when the chooser
        made it a probe of a slow replica, else the shard's p95."""
        if probe:
            return 0.0
        p95 = self._p95(shard)
        return self.initial_delay_s if p95 is None else max(self.min_delay_s, p95)

    def try_hedge(self, probe: bool = False) -> bool:
        """Spend one hedge from the budget; False (counted) when it is spent. A hedge of a probe (the
        chooser sent the first request to a slow replica) may take the last token; others leave
        `probe_reserve`."""
        need = 1.0 if probe else 1.0 + self.probe_reserve
        if self._tokens >= need:
            self._tokens -= 1.0
            self.hedges += 1
            return True
        self.denied += 1
        return False

    def statistics(self) -> HedgeStatistics:
        return HedgeStatistics(
            self.requests,
            self.hedges,
            self.denied,
            round(self._tokens, 3),
            tuple(self._p95(s) for s in range(len(self._sorted))),
        )
