"""Static (request-level) batching, the benchmark baseline: under arbitrary arrivals, steps and aborts,
nothing is admitted while anything runs, a batch never exceeds max_num_seqs, never preempts, and every
sequence finishes exactly once with its full, correct output."""

from __future__ import annotations

import zlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inferd.clock import FakeClock
from inferd.kinds.llm import BULK, INTERACTIVE, FinishReason, SchedulerConfig, SeqOutput, StepPlan
from inferd.kinds.llm.engine import new_scheduler
from inferd.kinds.llm.scheduler import LLMScheduler
from inferd.kinds.llm.static_scheduler import StaticBatchScheduler


def token_at(seq_id: str, position: int) -> int:
    return zlib.crc32(f"{seq_id}:{position}".encode()) % 40 + 1


def sample(plan: StepPlan) -> dict[str, SeqOutput]:
    """A model that samples token_at(seq, position) for every sampling chunk (never stops early)."""
    return {
        c.seq_id: SeqOutput(token_at(c.seq_id, c.start + len(c.token_ids))) for c in plan.chunks if c.samples
    }


configs = st.builds(
    lambda bs, blocks, seqs, extra: SchedulerConfig(
        policy="static",
        block_size=bs,
        num_blocks=blocks,
        max_num_seqs=seqs,
        max_num_batched_tokens=seqs + extra,
    ),
    st.sampled_from([2, 4]),
    st.integers(8, 40),
    st.integers(1, 5),
    st.integers(1, 24),
)


class StaticMachine(RuleBasedStateMachine):
    @initialize(config=configs)
    def setup(self, config: SchedulerConfig) -> None:
        self.sched = new_scheduler(config, FakeClock())
        assert isinstance(self.sched, StaticBatchScheduler)
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.max_tokens: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.ended: dict[str, list[FinishReason]] = {}
        self.batch: set[str] = set()
        """The running batch: sequences admitted since the engine was last idle, not yet ended."""

    @rule(
        prompt=st.lists(st.integers(1, 50), min_size=1, max_size=12),
        max_tokens=st.integers(1, 8),
        priority=st.sampled_from([INTERACTIVE, BULK]),
    )
    def add(self, prompt: list[int], max_tokens: int, priority: int) -> None:
        seq_id = f"s{len(self.prompts)}"
        if len(prompt) + max_tokens > self.sched.config.max_seq_tokens:
            return
        self.sched.add(seq_id, prompt, max_tokens, priority=priority)
        self.prompts[seq_id] = tuple(prompt)
        self.max_tokens[seq_id] = max_tokens
        self.outputs[seq_id] = []
        self.ended[seq_id] = []

    @rule()
    def step(self) -> None:
        running_before = set(self.sched.running_ids())
        plan = self.sched.schedule()
        cfg = self.sched.config
        if running_before:
            assert plan.admitted == (), f"admitted {plan.admitted} while {sorted(running_before)} ran"
        else:
            self.batch = set(plan.admitted)
        assert plan.preempted == ()
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        assert set(self.sched.running_ids()) <= self.batch
        assert len(self.batch) <= cfg.max_num_seqs
        for delta in self.sched.apply(plan, sample(plan)):
            self.outputs[delta.seq_id].extend(delta.token_ids)
            if delta.finish_reason is not None:
                self.ended[delta.seq_id].append(delta.finish_reason)
                self.batch.discard(delta.seq_id)

    @precondition(lambda self: bool(self.sched.running_ids() or self.sched.waiting_ids()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.sched.running_ids() + self.sched.waiting_ids()))
        assert self.sched.abort(seq_id)
        self.ended[seq_id].append(FinishReason.ABORT)
        self.batch.discard(seq_id)

    @invariant()
    def kv_within_reservations(self) -> None:
        stats = self.sched.statistics()
        assert stats.kv_blocks_used <= self.sched.config.num_blocks
        assert stats.preemptions == 0

    def teardown(self) -> None:
        bound = 10 + sum(len(p) + self.max_tokens[s] for s, p in self.prompts.items())
        for _ in range(bound):
            if not self.sched.has_work():
                break
            self.step()
        assert not self.sched.has_work(), f"work left after {bound} steps: {self.sched.statistics()}"
        assert self.sched.statistics().kv_blocks_used == 0
        for seq_id, ends in self.ended.items():
            assert len(ends) == 1, f"{seq_id} ended {ends}"
            want = [token_at(seq_id, len(self.prompts[seq_id]) + i) for i in range(self.max_tokens[seq_id])]
            if ends[0] is FinishReason.LENGTH:
                assert self.outputs[seq_id] == want
            else:
                assert self.outputs[seq_id] == want[: len(self.outputs[seq_id])]


StaticMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_static_scheduler_state_machine = StaticMachine.TestCase


def drain(sched: LLMScheduler) -> list[tuple[str, ...]]:
    """Run to completion; return each step's admissions."""
    admitted = []
    for _ in range(1000):
        if not sched.has_work():
            return admitted
        plan = sched.schedule()
        admitted.append(plan.admitted)
        sched.apply(plan, sample(plan))
    raise AssertionError("did not drain")


def test_a_short_request_waits_for_the_whole_batch_in_static_mode_and_not_in_continuous() -> None:
    """The difference the benchmark measures: 'late' arrives while a long and a short sequence run."""
    steps_to_admit = {}
    for policy in ("static", "continuous"):
        cfg = SchedulerConfig(
            policy=policy, block_size=4, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=16
        )
        sched = new_scheduler(cfg, FakeClock())
        sched.add("long", [1, 2, 3], 20)
        sched.add("short", [4, 5, 6], 2)
        admitted = drain_until_admitted(sched, "late", after_steps=3)
        steps_to_admit[policy] = admitted
    assert steps_to_admit["continuous"] <= 4  # a seat frees when 'short' ends
    assert steps_to_admit["static"] >= 20  # only after 'long' has produced all 20 tokens


def drain_until_admitted(sched: LLMScheduler, seq_id: str, after_steps: int) -> int:
    """Step; add `seq_id` after `after_steps` steps; return the step at which it was admitted."""
    for i in range(1000):
        if i == after_steps:
            sched.add(seq_id, [7, 8, 9], 2)
        plan = sched.schedule()
        if seq_id in plan.admitted:
            return i
        sched.apply(plan, sample(plan))
    raise AssertionError(f"{seq_id} never admitted")


def test_a_static_batch_admits_as_many_as_fit_their_full_reservation() -> None:
    # 8 blocks of 4 tokens; each sequence reserves ceil((4 + 8) / 4) = 3 blocks: two fit, the third waits.
    cfg = SchedulerConfig(
        policy="static", block_size=4, num_blocks=8, max_num_seqs=4, max_num_batched_tokens=64
    )
    sched = new_scheduler(cfg, FakeClock())
    for i in range(3):
        sched.add(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4], 8)
    admissions = [a for a in drain(sched) if a]
    assert admissions == [("r0", "r1"), ("r2",)]
    assert sched.statistics().preemptions == 0 and sched.statistics().finished == 3
