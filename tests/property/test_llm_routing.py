"""The LLM front end's routing policy (PrefixAffinityRouter) on a fake clock.

Invariants: it never picks a worker that is not routable or whose engine queue is full, and answers None
exactly when no such worker exists; the chosen worker's load stays within the cap over the least-loaded
candidate, and it is the healthiest within the cap (READY before PROBING); with many requests sharing one prefix, the load spread stays within the cap; with equal
loads the worker holding the prefix wins; the front end names blocks exactly as the worker's scheduler.
"""

from __future__ import annotations

import hashlib
import math

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from inferd.clock import FakeClock
from inferd.kinds.llm.kv import hash_block, hash_blocks
from inferd.kinds.llm.plan import SchedulerConfig
from inferd.kinds.llm.routing import Choice, PrefixAffinityRouter, RoutingConfig, WorkerLoad, home
from inferd.kinds.llm.sequence import Sequence
from inferd.routing.health import Health

SCHED = SchedulerConfig(block_size=4, num_blocks=64, max_waiting_seqs=3, max_waiting_prompt_tokens=40)
PREFIXES = [list(range(100 * k, 100 * k + 12)) for k in range(3)]


def router(clock: FakeClock | None = None, **routing: object) -> PrefixAffinityRouter:
    return PrefixAffinityRouter(RoutingConfig(**routing), SCHED, clock or FakeClock())  # type: ignore[arg-type]


workers_st = st.lists(
    st.builds(
        WorkerLoad,
        worker_id=st.just(""),
        health=st.sampled_from(list(Health)),
        live_seqs=st.integers(0, 30),
        waiting_seqs=st.integers(0, 4),
        waiting_prompt_tokens=st.integers(0, 45),
    ),
    min_size=0,
    max_size=30,  # past routing._VECTOR_FROM: `home` scores them with numpy
).map(lambda ws: [WorkerLoad(f"w{i}", *_fields(w)) for i, w in enumerate(ws)])


def _splitmix_home(worker_ids: list[str], block: bytes) -> str | None:
    """The rendezvous rule of `home`'s docstring, as plain integer arithmetic."""
    m64 = (1 << 64) - 1
    best, best_score = None, -1
    for w in worker_ids:
        key = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
        x = key ^ int.from_bytes(block[:8], "little")
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m64
        x ^= x >> 31
        if x > best_score:
            best, best_score = w, x
    return best


@settings(max_examples=200, deadline=None)
@given(n_workers=st.integers(0, 120), block=st.binary(min_size=32, max_size=32))
def test_home_is_the_rendezvous_winner_however_many_workers(n_workers: int, block: bytes) -> None:
    """Small sets are scored in a loop and large ones with numpy arrays: the same winner either way."""
    ids = [f"llm-{i}.0" for i in range(n_workers)]
    assert home(ids, block) == _splitmix_home(ids, block)


def _fields(w: WorkerLoad) -> tuple[Health, int, int, int]:
    return w.health, w.live_seqs, w.waiting_seqs, w.waiting_prompt_tokens


@settings(max_examples=300, deadline=None)
@given(
    workers=workers_st,
    remembered=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), st.integers(1, 3))),
    prefix=st.integers(0, 2),
    tail=st.integers(1, 8),
    extra=st.integers(1, 5),
    ratio=st.floats(1.0, 2.0),
)
def test_pick_respects_readiness_room_and_the_load_cap(
    workers: list[WorkerLoad],
    remembered: list[tuple[int, int, int]],
    prefix: int,
    tail: int,
    extra: int,
    ratio: float,
) -> None:
    r = router(max_extra_seqs=extra, max_load_ratio=ratio)
    for w, k, blocks in remembered:  # what earlier requests left on the workers
        r.record(f"w{w}", r.block_hashes(PREFIXES[k], "t")[:blocks])
    prompt = PREFIXES[prefix] + [7] * tail
    candidates = [w for w in workers if w.health in Health.ROUTABLE and r.has_room(w, len(prompt))]

    choice = r.pick(workers, r.block_hashes(prompt, "t"), len(prompt))

    if not candidates:
        assert choice is None
        return
    assert choice is not None
    chosen = next(w for w in workers if w.worker_id == choice.worker_id)
    assert chosen in candidates, "picked a worker that is not routable or has no room"
    min_load = min(w.live_seqs for w in candidates)
    limit = max(min_load + extra, math.floor(min_load * ratio))
    assert chosen.live_seqs + 1 <= limit
    assert chosen.health == max(w.health for w in candidates if w.live_seqs + 1 <= limit), (
        "not the healthiest"
    )


@settings(max_examples=100, deadline=None)
@given(n_workers=st.integers(2, 6), n_requests=st.integers(1, 200), extra=st.integers(1, 6))
def test_one_shared_prefix_never_piles_onto_one_worker(n_workers: int, n_requests: int, extra: int) -> None:
    """Every request carries the same long prefix; the cache-holder is always attractive, yet the
    spread between the busiest and the idlest worker never passes the cap."""
    r = router(max_extra_seqs=extra, max_load_ratio=1.0)
    loads = [0] * n_workers
    prompt = PREFIXES[0] + [1, 2, 3]
    hashes = r.block_hashes(prompt, "")
    hits = 0
    for _ in range(n_requests):
        views = [WorkerLoad(f"w{i}", Health.READY, load) for i, load in enumerate(loads)]
        choice = r.pick(views, hashes, 0)
        assert choice is not None
        hits += choice.cached_blocks > 0
        r.record(choice.worker_id, hashes)
        loads[int(choice.worker_id[1:])] += 1
        assert max(loads) - min(loads) <= extra
    assert hits >= n_requests - n_workers  # each worker computes the prefix once, then holds it


@settings(max_examples=200, deadline=None)
@given(n_workers=st.integers(2, 6), holder=st.integers(0, 5), load=st.integers(0, 20), k=st.integers(0, 2))
def test_equal_loads_go_to_the_worker_holding_the_prefix(
    n_workers: int, holder: int, load: int, k: int
) -> None:
    holder %= n_workers
    r = router()
    r.record(f"w{holder}", r.block_hashes(PREFIXES[k], "t"))
    prompt = PREFIXES[k] + [9, 9]
    views = [WorkerLoad(f"w{i}", Health.READY, load) for i in range(n_workers)]
    choice = r.pick(views, r.block_hashes(prompt, "t"), len(prompt))
    assert choice is not None
    assert (choice.worker_id, choice.cached_blocks) == (f"w{holder}", len(PREFIXES[k]) // SCHED.block_size)
    assert r.statistics().affinity_hits == 1


def test_another_tenant_and_an_old_memory_do_not_count_as_cached() -> None:
    clock = FakeClock()
    r = router(clock, affinity_ttl_s=30.0)
    prompt = PREFIXES[1] + [5]
    r.record("w1", r.block_hashes(prompt, "alice"))
    views = [WorkerLoad("w0", Health.READY, 0), WorkerLoad("w1", Health.READY, 0)]
    bob = r.block_hashes(prompt, "bob")
    other = r.pick(views, bob, len(prompt))  # nothing cached for bob: his prefix's rendezvous home
    assert other is not None and (other.worker_id, other.cached_blocks) == (home(["w0", "w1"], bob[0]), 0)
    clock.advance(31.0)
    alice = r.block_hashes(prompt, "alice")
    stale = r.pick(views, alice, len(prompt))
    assert stale is not None and (stale.worker_id, stale.cached_blocks) == (home(["w0", "w1"], alice[0]), 0)


def test_memory_per_worker_is_bounded() -> None:
    r = router(remembered_blocks=5)
    for k in range(3):
        r.record("w0", r.block_hashes(PREFIXES[k], ""))
    assert r.remembered("w0") == 5
    r.forget("w0")
    assert r.remembered("w0") == 0


def test_a_prompt_whose_first_block_was_forgotten_counts_as_cached_nowhere() -> None:
    r = router(remembered_blocks=3)  # PREFIXES have 3 full blocks of 4
    views = [WorkerLoad("w0", Health.READY, 0), WorkerLoad("w1", Health.READY, 0)]
    first, second = (r.block_hashes(PREFIXES[k], "") for k in range(2))
    r.record("w1", first)
    assert r.pick(views, first, 12) == Choice("w1", 3, False)
    r.record("w1", second)  # evicts every block of the first prompt from w1's memory
    assert r.pick(views, first, 12).cached_blocks == 0
    assert r.pick(views, second, 12) == Choice("w1", 3, False)
    r.record("w0", second)
    r.forget("w1")
    assert r.pick(views, second, 12) == Choice("w0", 3, False)
    r.forget("w0")
    assert r.pick(views, second, 12).cached_blocks == 0


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 2**31), min_size=1, max_size=70),
    tenant=st.text(max_size=5),
    block_size=st.integers(1, 16),
)
def test_front_end_names_blocks_as_the_worker_does(prompt: list[int], tenant: str, block_size: int) -> None:
    sched = SchedulerConfig(block_size=block_size)
    r = PrefixAffinityRouter(RoutingConfig(), sched, FakeClock())
    seq = Sequence("s", tuple(prompt), 1, tenant)
    seq.extend_hashes(block_size)
    assert r.block_hashes(prompt, tenant) == seq.block_hashes


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40),
    block_size=st.integers(1, 8),
    salt=st.text(max_size=4),
    chained=st.booleans(),
)
def test_hash_blocks_names_as_hash_block_chained(
    tokens: list[int], block_size: int, salt: str, chained: bool
) -> None:
    parent = hash_block(None, [7], "p") if chained else None
    expected, name = [], parent
    for i in range(len(tokens) // block_size):
        name = hash_block(name, tokens[i * block_size : (i + 1) * block_size], salt)
        expected.append(name)
    assert hash_blocks(parent, tokens, salt, block_size) == expected
    if block_size > 1:  # a partial last block is not named, and not read: any int may sit there
        full = tokens[: len(expected) * block_size]
        assert hash_blocks(parent, [*full, 2**70], salt, block_size) == expected


class RoutingWithCompletions(RuleBasedStateMachine):
    """Arrivals with a few shared prefixes, completions and workers going up and down: every pick
    stays within the cap of that moment, and only ever lands on a ready worker."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.r = router(self.clock, max_extra_seqs=2, max_load_ratio=1.5)
        self.loads = {f"w{i}": 0 for i in range(3)}
        self.ready = {w: True for w in self.loads}

    def views(self) -> list[WorkerLoad]:
        health = {True: Health.READY, False: Health.DRAINING}
        return [WorkerLoad(w, health[self.ready[w]], n) for w, n in self.loads.items()]

    @rule(k=st.integers(0, 2), tail=st.integers(0, 5))
    def arrive(self, k: int, tail: int) -> None:
        prompt = PREFIXES[k] + [3] * tail
        hashes = self.r.block_hashes(prompt, "")
        choice = self.r.pick(self.views(), hashes, 0)
        live = [n for w, n in self.loads.items() if self.ready[w]]
        if not live:
            assert choice is None
            return
        assert choice is not None and self.ready[choice.worker_id]
        assert self.loads[choice.worker_id] + 1 <= self.r.cap(min(live))
        self.loads[choice.worker_id] += 1
        self.r.record(choice.worker_id, hashes)

    @rule(w=st.sampled_from(["w0", "w1", "w2"]))
    def complete(self, w: str) -> None:
        self.loads[w] = max(0, self.loads[w] - 1)

    @rule(w=st.sampled_from(["w0", "w1", "w2"]))
    def toggle_ready(self, w: str) -> None:
        self.ready[w] = not self.ready[w]
        if not self.ready[w]:
            self.loads[w] = 0
            self.r.forget(w)

    @rule(s=st.floats(0.0, 40.0))
    def time_passes(self, s: float) -> None:
        self.clock.advance(s)

    @invariant()
    def memory_bounded(self) -> None:
        assert all(self.r.remembered(w) <= self.r.capacity for w in self.loads)


TestRoutingWithCompletions = RoutingWithCompletions.TestCase
TestRoutingWithCompletions.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
