"""The hedge delay is the p95 of exactly the last `window` latencies, as samples come and go."""

from __future__ import annotations

import random

from inferd.clock import FakeClock
from inferd.kinds.search.hedge import HedgePolicy


def test_the_p95_follows_the_sliding_window_exactly() -> None:
    rng = random.Random(7)
    policy = HedgePolicy(FakeClock(), shards=1, window=50, min_samples=10, min_delay_s=0.0)
    seen: list[float] = []
    for i in range(400):
        latency = rng.choice([0.001, 0.002, 0.004, rng.random() / 10])  # repeated values included
        policy.observe(0, latency)
        seen.append(latency)
        last = sorted(seen[-50:])
        want = last[int(0.95 * (len(last) - 1))] if len(last) >= 10 else policy.initial_delay_s
        assert policy.delay_s(0) == want, i
