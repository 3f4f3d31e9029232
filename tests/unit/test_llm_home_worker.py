"""Prefix affinity across front ends: a prompt's home worker is computed, so two routers with no shared
memory (two front ends) send prompts sharing a first block to the same worker."""

from __future__ import annotations

import hashlib
from collections import Counter

from inferd.clock import FakeClock
from inferd.kinds.llm.plan import SchedulerConfig
from inferd.kinds.llm.routing import PrefixAffinityRouter, RoutingConfig, WorkerLoad, home
from inferd.routing.health import Health


def test_two_front_ends_route_a_shared_prefix_to_the_same_worker() -> None:
    scheduler = SchedulerConfig()
    workers = [WorkerLoad(f"w{i}", Health.READY, live_seqs=0) for i in range(4)]
    prompt = list(range(3 * scheduler.block_size))
    picks = set()
    for _ in range(2):  # two front ends: two routers, nothing remembered
        router = PrefixAffinityRouter(RoutingConfig(), scheduler, FakeClock())
        hashes = router.block_hashes(prompt, "tenant")
        choice = router.pick(workers, hashes, len(prompt))
        assert choice is not None
        picks.add(choice.worker_id)
    assert len(picks) == 1


def test_a_leaving_worker_moves_only_its_own_prompts() -> None:
    ids = [f"w{i}" for i in range(5)]
    blocks = [bytes([i, i + 1]) for i in range(200)]
    before = {b: home(ids, b) for b in blocks}
    after = {b: home(ids[:-1], b) for b in blocks}
    moved = [b for b in blocks if before[b] != after[b]]
    assert moved and all(before[b] == "w4" for b in moved)


def test_homes_spread_evenly_over_the_workers() -> None:
    ids = [f"llm-{i}.0" for i in range(8)]
    blocks = [hashlib.sha256(str(i).encode()).digest() for i in range(16_000)]
    counts = Counter(home(ids, b) for b in blocks)
    assert set(counts) == set(ids)
    assert max(counts.values()) < 1.1 * 2_000 and min(counts.values()) > 0.9 * 2_000
