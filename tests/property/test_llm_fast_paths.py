"""The scheduler's and the KV pool's per-token fast paths decide exactly what their general paths do.

* `LLMScheduler` schedules a decode inline while its last block has room, names and publishes blocks
  only when one fills, sorts its running set only after an admission broke the order, and hands the
  model the block table it keeps on the running Sequence. A reference subclass sorts every step,
  sends every decode through `_schedule_running` (`kv.grow`), and names and publishes after every chunk: under random arrivals, aborts, model stops and errors and a small KV
  pool (preemptions), both give the same plans, deltas and statistics, for both policies.
* `BlockPool` keeps never-used blocks out of its free list; a reference pool that lists every block
  from the start hands out the same block ids in the same order and evicts the same names.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.errors import ServingError
from inferd.kinds.llm.kv import BlockPool, hash_block
from inferd.kinds.llm.plan import Delta, Recorded, ScheduledChunk, SchedulerConfig, SeqOutput, StepPlan
from inferd.kinds.llm.scheduler import LLMScheduler, _Step
from inferd.kinds.llm.sequence import FinishReason, SeqStatus, Sequence
from inferd.kinds.llm.static_scheduler import StaticBatchScheduler


class _GeneralPaths:
    """Mixed into a scheduler: every decode through `_schedule_running`, every chunk names and publishes."""

    def _schedule_decodes(self, step: _Step) -> tuple[list[Sequence], list[Sequence]]:
        """Sorts the running set every step, splits it before scheduling anything, and sends every
        decode through `_schedule_running`."""
        running: list[Sequence] = self._running  # type: ignore[attr-defined]
        running.sort(key=lambda s: (s.priority, s.admitted))
        decodes = [s for s in running if s.num_pending == 1]
        prefills: tuple[list[Sequence], list[Sequence]] = ([], [])
        for seq in running:
            if seq.num_pending > 1:
                prefills[seq.priority].append(seq)
        for seq in decodes:
            self._schedule_running(seq, step)  # type: ignore[attr-defined]
        return prefills

    def record(self, plan: StepPlan, outputs: Mapping[str, SeqOutput]) -> Recorded:
        """Chunk by chunk through `_record_one`; single tokens that go on into the columns."""
        self._close_step(plan, outputs)  # type: ignore[attr-defined]
        out = Recorded([], [], [])
        for chunk in plan.chunks:
            seq = self._seqs.get(chunk.seq_id)  # type: ignore[attr-defined]
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue
            delta = self._record_one(seq, chunk, outputs.get(chunk.seq_id))
            if delta is None:
                continue
            if delta.finish_reason is None and len(delta.token_ids) == 1:
                out.ids.append(delta.seq_id)
                out.tokens.append(delta.token_ids[0])
            else:
                out.deltas.append(delta)
        return out

    def _record_one(self, seq: Sequence, chunk: ScheduledChunk, out: SeqOutput | None) -> Delta | None:
        seq.num_computed += len(chunk.token_ids)
        token = out.token if out else None
        finish = out.finish if out else None
        if chunk.samples and token is None and finish is None:
            finish = FinishReason.ERROR
        if token is not None:
            seq.output.append(token)
        kv = self.kv  # type: ignore[attr-defined]
        seq.extend_hashes(kv.block_size)
        kv.publish_computed(seq.seq_id, seq.block_hashes, seq.num_computed)
        if finish is None and len(seq.output) >= seq.max_tokens:
            finish = FinishReason.LENGTH
        if finish is not None:
            self._finish(seq, finish)  # type: ignore[attr-defined]
        if token is None and finish is None:
            return None
        return Delta(seq.seq_id, () if token is None else (token,), finish)


class GeneralScheduler(_GeneralPaths, LLMScheduler):
    pass


class GeneralStaticScheduler(_GeneralPaths, StaticBatchScheduler):
    pass


def _trace(sched: LLMScheduler, seed: int, steps: int) -> list:
    """Drive `sched` with a workload drawn from `seed`; everything it decided, in order."""
    rng = random.Random(seed)
    clock = sched.clock
    trace: list = []
    live: list[str] = []
    for i in range(steps):
        for j in range(rng.randint(0, 3)):
            sid = f"s{i}.{j}"
            prompt = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9], []]) + [
                rng.randint(0, 50) for _ in range(rng.randint(1, 40))
            ]
            try:
                sched.add(sid, prompt, rng.randint(1, 30), rng.choice(["", "a"]), rng.choice([0, 1]))
                live.append(sid)
            except ServingError as exc:
                trace.append(("refused", sid, type(exc).__name__))
        if live and rng.random() < 0.1:
            sid = rng.choice(live)
            trace.append(("abort", sid, sched.abort(sid)))
        if not sched.has_work():
            continue
        plan = sched.schedule()
        for c in plan.chunks:
            assert c.block_ids == sched.kv.blocks_of(c.seq_id)
        trace.append(plan)
        if live and rng.random() < 0.05:
            sched.abort(rng.choice(live))
        outputs = {}
        for c in plan.chunks:
            if c.samples:
                r = rng.random()
                if r < 0.9:
                    outputs[c.seq_id] = SeqOutput(token=rng.randint(0, 50))
                elif r < 0.95:
                    outputs[c.seq_id] = SeqOutput(token=7, finish=FinishReason.STOP)
                else:
                    outputs[c.seq_id] = SeqOutput()
        clock.advance(0.01)
        trace.append(sched.apply(plan, outputs))
        trace.append((sched.statistics(), sched.kv.pool.statistics(), sched.kv.held()))
    return trace


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 4, 16]),
    num_blocks=st.sampled_from([40, 80, 400]),
    budget=st.sampled_from([64, 512]),
    static=st.booleans(),
    prefix_caching=st.booleans(),
)
def test_fast_paths_schedule_as_the_general_path(
    seed: int, block_size: int, num_blocks: int, budget: int, static: bool, prefix_caching: bool
) -> None:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=prefix_caching,
        max_waiting_seqs=50,
    )
    fast, general = (
        (StaticBatchScheduler, GeneralStaticScheduler) if static else (LLMScheduler, GeneralScheduler)
    )
    assert _trace(fast(config, FakeClock(0.0)), seed, 150) == _trace(
        general(config, FakeClock(0.0)), seed, 150
    )


class EagerPool:
    """The reference: every block on the free list from the start, least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    def allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            h = self.hashes[bid]
            if h is not None and self.cached.get(h) == bid:
                del self.cached[h]
            self.hashes[bid] = None
            self.refs[bid] = 1
            out.append(bid)
        return out

    def release(self, bid: int) -> None:
        self.refs[bid] -= 1
        if self.refs[bid] == 0:
            self.free[bid] = None

    def touch(self, bid: int) -> None:
        if self.refs[bid] == 0:
            del self.free[bid]
        self.refs[bid] += 1

    def publish(self, bid: int, h: bytes) -> None:
        if self.hashes[bid] is None and h not in self.cached:
            self.hashes[bid] = h
            self.cached[h] = bid


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(1, 24),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6)), max_size=80),
)
def test_lazy_block_pool_matches_an_eager_one(num_blocks: int, ops: list[tuple[int, int]]) -> None:
    pool, ref = BlockPool(num_blocks, 4), EagerPool(num_blocks)
    held: list[int] = []
    for op, x in ops:
        if op == 0 and len(ref.free):
            n = x % len(ref.free) + 1
            got = pool.allocate(n)
            assert got == ref.allocate(n)
            held += got
        elif op == 1 and held:
            bid = held.pop(x % len(held))
            pool.release([bid])
            ref.release(bid)
        elif op == 2 and held:
            name = hash_block(None, [x % 5], "")
            bid = held[x % len(held)]
            pool.publish(bid, name)
            ref.publish(bid, name)
        elif op == 3:
            bid = pool.lookup(hash_block(None, [x % 5], ""))
            assert bid == ref.cached.get(hash_block(None, [x % 5], ""))
            if bid is not None:
                pool.touch([bid])
                ref.touch(bid)
                held.append(bid)
        assert pool.num_free == len(ref.free)
        assert all(pool.ref_count(b) == ref.refs[b] for b in range(num_blocks))
        assert pool.statistics().cached == len(ref.cached)
