"""LLM scheduler invariants (ROADMAP Part 3) under arbitrary interleavings of arrivals, steps,
aborts (also between schedule() and apply()) and model errors, with a fake model whose token at each
position is a pure function of (sequence id, position), and a fake KV store that checks every chunk
reads back exactly the tokens (and tenant) it expects.

Invariants: the token budget, seat limit and KV pool are never exceeded; every sequence ends exactly
once; preempted sequences produce the same tokens as an unpreempted run; decodes are never stalled;
the head of the waiting queue is admitted when resources allow; interactive never waits behind bulk;
aborts free blocks at once; prefix-cache hits happen within a tenant and never across tenants.
"""

from __future__ import annotations

import math
import zlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inferd.clock import FakeClock
from inferd.errors import BadRequest
from inferd.kinds.llm import (
    BULK,
    INTERACTIVE,
    FinishReason,
    LLMScheduler,
    SchedulerConfig,
    SchedulerFull,
    SeqOutput,
    SeqStatus,
    StepPlan,
)

STOP_TOKEN = 7
PREFIXES = (tuple(range(100, 112)), tuple(range(200, 206)), ())


def token_at(seq_id: str, position: int) -> int:
    return zlib.crc32(f"{seq_id}:{position}".encode()) % 40 + 1


def expected_output(seq_id: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[list[int], FinishReason]:
    out: list[int] = []
    while True:
        tok = token_at(seq_id, len(prompt) + len(out))
        out.append(tok)
        if tok == STOP_TOKEN:
            return out, FinishReason.STOP
        if len(out) >= max_tokens:
            return out, FinishReason.LENGTH


class FakeModel:
    """Runs a plan: checks that each chunk reads what its sequence wrote (KV content keyed by tenant
    and token), writes its own tokens, and samples token_at(seq, position)."""

    def __init__(self, sched: LLMScheduler) -> None:
        self.sched = sched
        self.bs = sched.config.block_size
        self.store: dict[int, dict[int, tuple[str, int]]] = {}
        self.fail: set[str] = set()

    def run(self, plan: StepPlan, reqs: dict[str, Request]) -> dict[str, SeqOutput]:
        outputs = {}
        for c in plan.chunks:
            req = reqs[c.seq_id]
            tokens = req.prompt + tuple(req.output)
            n = len(c.token_ids)
            assert c.token_ids == tokens[c.start : c.start + n]
            assert len(c.block_ids) >= math.ceil((c.start + n) / self.bs)
            for p in range(c.start):
                got = self.store.get(c.block_ids[p // self.bs], {}).get(p % self.bs)
                assert got == (req.tenant, tokens[p]), f"{c.seq_id} pos {p}: KV holds {got}"
            for p in range(c.start, c.start + n):
                blk = c.block_ids[p // self.bs]
                assert self.sched.kv.pool.ref_count(blk) == 1, f"write into shared block {blk}"
                self.store.setdefault(blk, {})[p % self.bs] = (req.tenant, tokens[p])
            if c.seq_id in self.fail:
                self.fail.discard(c.seq_id)
                outputs[c.seq_id] = SeqOutput(finish=FinishReason.ERROR)
            elif c.samples:
                tok = token_at(c.seq_id, c.start + n)
                outputs[c.seq_id] = SeqOutput(tok, FinishReason.STOP if tok == STOP_TOKEN else None)
        return outputs


class Request:
    def __init__(self, seq_id: str, prompt: tuple[int, ...], max_tokens: int, tenant: str, priority: int):
        self.seq_id = seq_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.tenant = tenant
        self.priority = priority
        self.output: list[int] = []
        self.ended: FinishReason | None = None


configs = st.builds(
    lambda bs, blocks, seqs, extra, wait: SchedulerConfig(
        block_size=bs,
        num_blocks=blocks,
        max_num_seqs=seqs,
        max_num_batched_tokens=seqs + extra,
        max_waiting_seqs=wait,
        max_waiting_prompt_tokens=wait * 12,
    ),
    st.sampled_from([2, 4]),
    st.integers(6, 24),
    st.integers(1, 5),
    st.integers(1, 24),
    st.integers(2, 8),
)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(config=configs)
    def setup(self, config: SchedulerConfig) -> None:
        self.clock = FakeClock()
        self.sched = LLMScheduler(config, self.clock)
        self.model = FakeModel(self.sched)
        self.reqs: dict[str, Request] = {}
        self.count = 0
        self.sampled_last: set[str] = set()

    def live(self) -> list[Request]:
        return [r for r in self.reqs.values() if r.ended is None]

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(1, 50), max_size=8),
        max_tokens=st.integers(1, 10),
        tenant=st.sampled_from(["a", "b"]),
        priority=st.sampled_from([INTERACTIVE, BULK]),
    )
    def add(self, prefix, suffix, max_tokens, tenant, priority) -> None:
        prompt = prefix + tuple(suffix) or (1,)
        seq_id = f"s{self.count}"
        self.count += 1
        cfg = self.sched.config
        before = self.sched.statistics()
        try:
            self.sched.add(seq_id, prompt, max_tokens, tenant, priority)
        except BadRequest:
            assert len(prompt) + max_tokens > cfg.max_seq_tokens
            return
        except SchedulerFull as e:
            assert e.retry_after_s > 0
            new_waiting = sum(1 for r in self.live() if self.sched.status(r.seq_id) is SeqStatus.WAITING)
            assert (
                new_waiting >= cfg.max_waiting_seqs
                or before.waiting_prompt_tokens + len(prompt) > cfg.max_waiting_prompt_tokens
            )
            return
        self.reqs[seq_id] = Request(seq_id, prompt, max_tokens, tenant, priority)

    @rule()
    def step(self) -> None:
        self._step(abort_index=None)

    @rule(i=st.integers(0, 10))
    def step_with_abort_in_flight(self, i: int) -> None:
        self._step(abort_index=i)

    @precondition(lambda self: any(True for _ in self.live()))
    @rule(data=st.data())
    def abort(self, data) -> None:
        req = data.draw(st.sampled_from(self.live()))
        self._abort(req)

    @precondition(lambda self: any(True for _ in self.live()))
    @rule(data=st.data())
    def model_fails_on(self, data) -> None:
        self.model.fail.add(data.draw(st.sampled_from(self.live())).seq_id)

    def _abort(self, req: Request) -> None:
        blocks = self.sched.kv.blocks_of(req.seq_id)
        refs = [self.sched.kv.pool.ref_count(b) for b in blocks]
        assert self.sched.abort(req.seq_id)
        assert self.sched.kv.blocks_of(req.seq_id) == ()
        for b, r in zip(blocks, refs, strict=True):
            assert self.sched.kv.pool.ref_count(b) == r - 1
        assert self.sched.status(req.seq_id) is None
        req.ended = FinishReason.ABORT

    def _step(self, abort_index: int | None) -> None:
        before_running = set(self.sched.running_ids())
        plan = self.sched.schedule()
        self._check_plan(plan, before_running)
        outputs = self.model.run(plan, self.reqs)
        if abort_index is not None and plan.chunks:
            chunk = plan.chunks[abort_index % len(plan.chunks)]
            self._abort(self.reqs[chunk.seq_id])
            outputs.pop(chunk.seq_id, None)
        self.clock.advance_ms(20)
        deltas = self.sched.apply(plan, outputs)
        self.sampled_last = set()
        for d in deltas:
            req = self.reqs[d.seq_id]
            assert req.ended is None, f"{d.seq_id} streamed after it ended ({req.ended})"
            req.output.extend(d.token_ids)
            if d.token_ids:
                self.sampled_last.add(d.seq_id)
            if d.finish_reason is not None:
                req.ended = d.finish_reason
                assert self.sched.status(d.seq_id) is None

    def _check_plan(self, plan: StepPlan, before_running: set[str]) -> None:
        cfg = self.sched.config
        stats = self.sched.statistics()
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        assert len(plan.chunks) <= cfg.max_num_seqs
        assert stats.running <= cfg.max_num_seqs
        assert stats.kv_blocks_used <= cfg.num_blocks
        assert len({c.seq_id for c in plan.chunks}) == len(plan.chunks)
        scheduled = {c.seq_id for c in plan.chunks}
        running = set(self.sched.running_ids())
        # decodes are never stalled: whoever sampled last step and still runs decodes now
        assert (self.sampled_last & running) <= scheduled
        # interactive never waits behind bulk
        waiting = self.sched.waiting_ids()
        if any(self.reqs[s].priority == INTERACTIVE for s in waiting):
            assert all(self.reqs[s].priority == INTERACTIVE for s in plan.admitted)
            bulk_running = any(self.reqs[s].priority == BULK for s in running)
            assert not bulk_running or plan.num_tokens == cfg.max_num_batched_tokens
        # the head is admitted when a seat, budget and blocks allow
        if waiting and waiting[0] not in plan.preempted:
            head = self.reqs[waiting[0]]
            need = math.ceil((len(head.prompt) + len(head.output)) / cfg.block_size)
            free = cfg.num_blocks - stats.kv_blocks_used
            assert not (
                stats.running < cfg.max_num_seqs
                and plan.num_tokens < cfg.max_num_batched_tokens
                and free >= need
            ), f"head {head.seq_id} left waiting with room for it"
        # every admitted sequence is in the plan, every plan entry runs
        assert set(plan.admitted) <= scheduled <= running

    @invariant()
    def accounted(self) -> None:
        if not hasattr(self, "sched"):
            return
        stats = self.sched.statistics()
        live = self.live()
        assert stats.running + stats.waiting == len(live)
        for r in live:
            assert self.sched.status(r.seq_id) not in SeqStatus.TERMINAL

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        bound = 50 + sum(3 * (len(r.prompt) + r.max_tokens) for r in self.live())
        for _ in range(bound):
            if not self.sched.has_work():
                break
            self._step(abort_index=None)
        assert not self.sched.has_work(), f"work left after {bound} steps: {self.sched.statistics()}"
        stats = self.sched.statistics()
        assert stats.kv_blocks_used == 0
        ended = [r.ended for r in self.reqs.values()]
        assert all(e is not None for e in ended)
        assert stats.finished == sum(e in (FinishReason.STOP, FinishReason.LENGTH) for e in ended)
        assert stats.aborted == sum(e is FinishReason.ABORT for e in ended)
        assert stats.errored == sum(e is FinishReason.ERROR for e in ended)
        for r in self.reqs.values():
            if r.ended in (FinishReason.STOP, FinishReason.LENGTH):
                assert (r.output, r.ended) == expected_output(r.seq_id, r.prompt, r.max_tokens)
            else:
                want, _ = expected_output(r.seq_id, r.prompt, r.max_tokens)
                assert r.output == want[: len(r.output)]


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_llm_scheduler_state_machine = SchedulerMachine.TestCase


# ---- focused examples ---------------------------------------------------------------------------


def drive(sched: LLMScheduler, reqs: dict[str, Request], model: FakeModel | None = None) -> None:
    model = model or FakeModel(sched)
    max_steps = 500
    for _ in range(max_steps):
        if not sched.has_work():
            return
        plan = sched.schedule()
        for d in sched.apply(plan, model.run(plan, reqs)):
            reqs[d.seq_id].output.extend(d.token_ids)
            if d.finish_reason is not None:
                reqs[d.seq_id].ended = d.finish_reason
    raise AssertionError("did not drain")


def submit(sched: LLMScheduler, reqs: dict[str, Request], seq_id, prompt, max_tokens, tenant="t", prio=0):
    sched.add(seq_id, prompt, max_tokens, tenant, prio)
    reqs[seq_id] = Request(seq_id, tuple(prompt), max_tokens, tenant, prio)


def test_preempted_sequences_produce_the_same_tokens_as_an_unpreempted_run() -> None:
    outputs = []
    for num_blocks in (12, 200):
        sched = LLMScheduler(
            SchedulerConfig(block_size=4, num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=16),
            FakeClock(),
        )
        reqs: dict[str, Request] = {}
        for i in range(4):
            submit(sched, reqs, f"r{i}", list(range(10 * i + 1, 10 * i + 9)), 16, prio=i % 2)
        drive(sched, reqs)
        outputs.append({k: (r.output, r.ended) for k, r in reqs.items()})
        if num_blocks == 12:
            assert sched.statistics().preemptions > 0
        else:
            assert sched.statistics().preemptions == 0
    assert outputs[0] == outputs[1]


def test_long_prompt_is_chunked_and_decodes_keep_running() -> None:
    sched = LLMScheduler(
        SchedulerConfig(block_size=4, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=8), FakeClock()
    )
    reqs: dict[str, Request] = {}
    model = FakeModel(sched)
    submit(sched, reqs, "short", [1, 2, 3], 30)
    plan = sched.schedule()
    sched.apply(plan, model.run(plan, reqs))
    reqs["short"].output.append(token_at("short", 3))
    submit(sched, reqs, "long", list(range(1, 41)), 2)
    chunks = 0
    while sched.status("long") is not None and reqs["long"].ended is None:
        plan = sched.schedule()
        by_id = {c.seq_id: c for c in plan.chunks}
        if "short" in sched.running_ids():
            assert len(by_id["short"].token_ids) == 1
        if "long" in by_id and not by_id["long"].samples:
            chunks += 1
        for d in sched.apply(plan, model.run(plan, reqs)):
            reqs[d.seq_id].output.extend(d.token_ids)
            if d.finish_reason is not None:
                reqs[d.seq_id].ended = d.finish_reason
    assert chunks >= 4


def test_prefix_cache_hits_within_a_tenant_and_never_across_tenants() -> None:
    sched = LLMScheduler(
        SchedulerConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64), FakeClock()
    )
    reqs: dict[str, Request] = {}
    model = FakeModel(sched)
    shared = list(range(1, 17))
    submit(sched, reqs, "a1", [*shared, 90], 2, tenant="a")
    drive(sched, reqs, model)
    assert sched.statistics().prefix_hit_tokens == 0
    submit(sched, reqs, "b1", [*shared, 91], 2, tenant="b")
    drive(sched, reqs, model)
    assert sched.statistics().prefix_hit_tokens == 0
    submit(sched, reqs, "a2", [*shared, 92], 2, tenant="a")
    drive(sched, reqs, model)
    stats = sched.statistics()
    assert stats.prefix_hit_tokens == 16
    assert stats.prefix_hit_ratio == pytest.approx(16 / (17 * 3))


def test_interactive_is_admitted_before_earlier_bulk() -> None:
    sched = LLMScheduler(
        SchedulerConfig(block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=8), FakeClock()
    )
    sched.add("bulk", [1, 2, 3], 2, priority=BULK)
    sched.add("inter", [4, 5, 6], 2, priority=INTERACTIVE)
    plan = sched.schedule()
    assert plan.admitted == ("inter",)
    assert sched.waiting_ids() == ["bulk"]


def test_bulk_is_not_admitted_while_the_interactive_head_waits_for_blocks() -> None:
    """The interactive head needs more blocks than are free and no bulk runs to preempt: a small bulk
    request that would fit must wait too (no inversion)."""
    sched = LLMScheduler(
        SchedulerConfig(block_size=4, num_blocks=6, max_num_seqs=4, max_num_batched_tokens=32), FakeClock()
    )
    sched.add("inter-running", list(range(1, 13)), 8)  # 3 blocks
    plan = sched.schedule()
    sched.apply(plan, {"inter-running": SeqOutput(11)})
    sched.add("inter-big", list(range(20, 36)), 2)  # 4 blocks + 1 for its token: does not fit in 3
    sched.add("bulk-small", [40, 41], 2, priority=BULK)  # 1 block: would fit
    plan = sched.schedule()
    assert plan.admitted == ()
    assert sched.waiting_ids() == ["inter-big", "bulk-small"]


def test_interactive_preempts_running_bulk_for_a_seat() -> None:
    sched = LLMScheduler(
        SchedulerConfig(block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=8), FakeClock()
    )
    sched.add("bulk", [1, 2, 3], 5, priority=BULK)
    plan = sched.schedule()
    sched.apply(plan, {"bulk": SeqOutput(11)})
    sched.add("inter", [4, 5, 6], 2)
    plan = sched.schedule()
    assert plan.admitted == ("inter",) and plan.preempted == ("bulk",)
    assert sched.status("bulk") is SeqStatus.PREEMPTED
    assert sched.output_of("bulk") == (11,)


def test_admission_limits_raise_scheduler_full_with_a_retry_hint() -> None:
    sched = LLMScheduler(
        SchedulerConfig(
            max_waiting_seqs=2, max_waiting_prompt_tokens=10, max_num_seqs=4, max_num_batched_tokens=8
        ),
        FakeClock(),
    )
    sched.add("a", [1] * 4, 1)
    with pytest.raises(SchedulerFull) as exc:
        sched.add("b", [1] * 7, 1)
    assert exc.value.limit == "max_waiting_prompt_tokens" and exc.value.retry_after_s > 0
    sched.add("c", [1] * 2, 1)
    with pytest.raises(SchedulerFull) as exc:
        sched.add("d", [1], 1)
    assert exc.value.limit == "max_waiting_seqs" and exc.value.retryable


def test_abort_frees_blocks_at_once() -> None:
    sched = LLMScheduler(
        SchedulerConfig(block_size=4, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=64), FakeClock()
    )
    sched.add("x", list(range(1, 11)), 5)
    plan = sched.schedule()
    assert sched.statistics().kv_blocks_used == 3
    assert sched.abort("x")
    assert sched.statistics().kv_blocks_used == 0
    assert sched.apply(plan, {}) == []
    assert not sched.abort("x")
