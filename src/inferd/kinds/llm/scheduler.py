"""The continuous-batching (iteration-level) LLM scheduler. A plain object: `schedule() -> StepPlan`,
then `apply(plan, outputs) -> list[Delta]`. It never awaits and does no I/O; the engine loop runs the
plan on the model and streams the deltas.

Each step, in this order, under `max_num_batched_tokens` and `max_num_seqs`:

1. one decode token for every running sequence that is decoding (decodes are never stalled by prefill);
2. per priority class (interactive, then bulk): the next prefill chunk of running sequences still
   prefilling, then new admissions from the head of that class's waiting queue. A long prompt is
   split over several steps (chunked prefill). Admission stops at the first sequence that cannot
   be admitted, so nobody overtakes the head of a class, and bulk is never admitted while an
   interactive sequence waits. Inside a class the tenants take turns by weight (kinds/llm/waiting.py):
   the head is the next tenant's oldest sequence, so a tenant's backlog never delays another's.

A sequence whose next tokens need a KV block when none is free preempts (recompute) the
lowest-priority, most recently admitted running sequence, possibly itself: its blocks are freed, it
goes back to the head of its waiting class with its generated tokens kept, and on resumption it
recomputes prompt + output (mostly from the prefix cache) and continues where it left off. An
interactive admission may also preempt running bulk sequences, for blocks or for a seat.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from operator import attrgetter

from inferd.clock import Clock
from inferd.errors import BadRequest
from inferd.kinds.llm.kv import KVCacheManager
from inferd.kinds.llm.plan import (
    Delta,
    Recorded,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerFull,
    SchedulerStatistics,
    SeqOutput,
    StepPlan,
)
from inferd.kinds.llm.sequence import FinishReason, SeqStatus, Sequence
from inferd.kinds.llm.waiting import WaitingClass
from inferd.routing.fairness import BULK, INTERACTIVE


@dataclass(slots=True)
class _Step:
    budget: int
    tokens: dict[str, int] = field(default_factory=dict)
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    def take(self, seq: Sequence, n: int) -> None:
        self.tokens[seq.seq_id] = n
        self.budget -= n

    def refund(self, seq: Sequence) -> None:
        self.budget += self.tokens.pop(seq.seq_id, 0)


_key = attrgetter("priority", "admitted")
"""Preemption order: the largest key goes first (lowest priority, most recently admitted)."""


class LLMScheduler:
    CLASSES = (INTERACTIVE, BULK)

    def __init__(self, config: SchedulerConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._seqs: dict[str, Sequence] = {}
        self._waiting = (WaitingClass(), WaitingClass())
        self._running: list[Sequence] = []
        self._in_order = True
        """`_running` is in preemption order (`_key`): true unless an admission broke it."""
        self._outstanding: StepPlan | None = None
        self._planned: list[Sequence] = []  # the outstanding plan's, chunk by chunk (record: no lookup)
        self._scheduled_at = 0.0
        self._step_s = config.initial_step_s
        self._arrivals = 0
        self._admissions = 0
        self._waiting_new = 0
        self._waiting_prompt_tokens = 0
        self._hit_tokens = 0
        self._query_tokens = 0
        self._preemptions = 0
        self._steps = 0
        self._ended = {s: 0 for s in SeqStatus.TERMINAL}

    # ---- requests ---------------------------------------------------------------------------

    def add(
        self,
        seq_id: str,
        prompt: Seq[int],
        max_tokens: int,
        tenant: str = "",
        priority: int = INTERACTIVE,
        output: Seq[int] = (),
        weight: float = 1.0,
    ) -> None:
        """Queue a new sequence. `output`: tokens it already generated elsewhere (resumed after its
        worker died); they count towards `max_tokens` and are recomputed like a preempted sequence's.
        `weight`: the tenant's, for its share of admissions inside the class."""
        self._check_request(seq_id, prompt, max_tokens, priority)
        if len(output) >= max_tokens:
            raise BadRequest(
                f"sequence {seq_id!r} resumes with {len(output)} tokens, max_tokens={max_tokens}: nothing left"
            )
        cfg = self.config
        if self._waiting_new >= cfg.max_waiting_seqs:
            raise SchedulerFull(
                f"{self._waiting_new} sequences waiting (max_waiting_seqs={cfg.max_waiting_seqs})",
                self._retry_after_s(),
                "max_waiting_seqs",
            )
        if self._waiting_prompt_tokens + len(prompt) > cfg.max_waiting_prompt_tokens:
            raise SchedulerFull(
                f"{self._waiting_prompt_tokens} prompt tokens waiting, {len(prompt)} more would pass "
                f"max_waiting_prompt_tokens={cfg.max_waiting_prompt_tokens}",
                self._retry_after_s(),
                "max_waiting_prompt_tokens",
            )
        seq = Sequence(
            seq_id, tuple(prompt), max_tokens, tenant, priority, self._arrivals, list(output), weight=weight
        )
        self._arrivals += 1
        self._seqs[seq_id] = seq
        self._waiting[priority].add(seq)
        self._waiting_new += 1
        self._waiting_prompt_tokens += len(prompt)

    def _check_request(self, seq_id: str, prompt: Seq[int], max_tokens: int, priority: int) -> None:
        if seq_id in self._seqs:
            raise BadRequest(f"sequence {seq_id!r} is already live")
        if not prompt:
            raise BadRequest(f"sequence {seq_id!r} has an empty prompt")
        if max_tokens < 1:
            raise BadRequest(f"sequence {seq_id!r}: max_tokens must be >= 1, got {max_tokens}")
        if priority not in self.CLASSES:
            raise BadRequest(f"sequence {seq_id!r}: priority must be 0 or 1, got {priority}")
        if len(prompt) + max_tokens > self.config.max_seq_tokens:
            raise BadRequest(
                f"sequence {seq_id!r}: prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the KV "
                f"pool ({self.config.max_seq_tokens} tokens)"
            )

    def abort(self, seq_id: str) -> bool:
        """End a live sequence now (client disconnect) and free its blocks. False if not live."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT)
        return True

    def status(self, seq_id: str) -> SeqStatus | None:
        """A live sequence's status; None once it has ended (or was never added)."""
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.status

    def waiting_ids(self) -> list[str]:
        """Waiting sequences in admission order (a copy, for inspection)."""
        return [s.seq_id for q in self._waiting for s in q.in_order()]

    def running_ids(self) -> list[str]:
        return [s.seq_id for s in self._running]

    def output_of(self, seq_id: str) -> tuple[int, ...]:
        return tuple(self._seqs[seq_id].output)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting[0] or self._waiting[1])

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        if self._outstanding is not None:
            raise RuntimeError(f"step {self._outstanding.step} is still outstanding: apply() it first")
        step = _Step(self.config.max_num_batched_tokens)
        if not self._in_order:
            self._running.sort(key=_key)
            self._in_order = True
        prefills = self._schedule_decodes(step)
        blocked = False
        for cls in self.CLASSES:
            for seq in prefills[cls]:  # those preempted meanwhile are skipped
                self._schedule_running(seq, step)
            if not blocked:  # a class whose head had to stay keeps every lower class waiting too
                blocked = not self._admit_class(cls, step)
        plan = self._build_plan(step)
        self._outstanding = plan
        self._scheduled_at = self.clock.now()
        return plan

    def _schedule_decodes(self, step: _Step) -> tuple[list[Sequence], list[Sequence]]:
        """One token for each running sequence that is decoding (1 token pending), in order: inline
        while its last block has room, else `_schedule_running` (grow, preempt). Returns, per class,
        those still prefilling; nothing joins a class's running set before its prefills are scheduled."""
        running = SeqStatus.RUNNING
        tokens = step.tokens
        prefills: tuple[list[Sequence], list[Sequence]] = ([], [])
        for seq in list(self._running):  # a growth may preempt (remove) one further on
            if seq.status is not running:
                continue
            pending = seq.prompt_len + len(seq.output) - seq.num_computed
            if pending > 1:
                prefills[seq.priority].append(seq)
            elif pending < 1 or step.budget == 0:
                continue
            elif seq.num_computed < seq.room:
                tokens[seq.seq_id] = 1
                step.budget -= 1
            else:
                self._schedule_running(seq, step)
        return prefills

    def _schedule_running(self, seq: Sequence, step: _Step) -> None:
        if seq.status is not SeqStatus.RUNNING or step.budget == 0:
            return
        n = min(seq.num_pending, step.budget)
        while not self.kv.grow(seq.seq_id, seq.num_computed + n):
            victim = max(self._running, key=_key)
            self._preempt(victim, step)
            if victim is seq:
                return
        seq.hold(self.kv.blocks_of(seq.seq_id), self.kv.block_size)
        step.take(seq, n)

    def _admit_class(self, cls: int, step: _Step) -> bool:
        """Admit from the head of one class; False if its head had to stay (so lower classes wait)."""
        queue = self._waiting[cls]
        while (seq := queue.head()) is not None:
            if seq.seq_id in step.preempted or step.budget == 0 or not self._seat_for(seq, step):
                return False
            seq.extend_hashes(self.config.block_size)
            while True:
                hit = self.kv.find_prefix(seq.block_hashes, seq.num_tokens)
                n = min(seq.num_tokens - hit.num_tokens, step.budget)
                if self.kv.admit(seq.seq_id, hit, hit.num_tokens + n):
                    break
                victim = self._lower_victim(seq)
                if victim is None:
                    return False
                self._preempt(victim, step)
            queue.pop(seq)
            self._start(seq, hit.num_tokens)
            step.take(seq, n)
            step.admitted.append(seq.seq_id)
        return True

    def _seat_for(self, seq: Sequence, step: _Step) -> bool:
        if len(self._running) < self.config.max_num_seqs:
            return True
        victim = self._lower_victim(seq)
        if victim is None:
            return False
        self._preempt(victim, step)
        return True

    def _lower_victim(self, seq: Sequence) -> Sequence | None:
        lower = [s for s in self._running if s.priority > seq.priority]
        return max(lower, key=_key) if lower else None

    def _start(self, seq: Sequence, hit_tokens: int) -> None:
        if seq.status is SeqStatus.WAITING:
            self._waiting_new -= 1
            self._waiting_prompt_tokens -= len(seq.prompt)
        seq.status = SeqStatus.RUNNING
        seq.num_computed = hit_tokens
        seq.hold(self.kv.blocks_of(seq.seq_id), self.kv.block_size)
        seq.admitted = self._admissions
        self._admissions += 1
        running = self._running
        if running and running[-1].priority > seq.priority:  # it goes before lower-priority ones
            self._in_order = False
        running.append(seq)
        self._hit_tokens += hit_tokens
        self._query_tokens += seq.num_tokens

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        step.refund(seq)
        if seq.seq_id in step.admitted:
            step.admitted.remove(seq.seq_id)
        self.kv.free(seq.seq_id)
        seq.hold((), 0)
        self._running.remove(seq)
        seq.status = SeqStatus.PREEMPTED
        seq.num_computed = 0
        seq.preemptions += 1
        self._preemptions += 1
        self._waiting[seq.priority].put_back(seq)
        step.preempted.append(seq.seq_id)

    def _build_plan(self, step: _Step) -> StepPlan:
        chunks = []
        tokens = step.tokens
        planned = self._planned = []
        for seq in self._running:
            n = tokens.get(seq.seq_id)
            if not n:
                continue
            planned.append(seq)
            start = seq.num_computed
            stop = start + n
            output = seq.output
            samples = stop == seq.prompt_len + len(output)
            ids = (output[-1],) if n == 1 and samples and output else seq.token_ids(start, stop)  # a decode
            chunks.append(ScheduledChunk(seq.seq_id, start, ids, seq.blocks, samples))
        admitted, preempted = tuple(step.admitted), tuple(step.preempted)
        return StepPlan(self._steps, tuple(chunks), admitted, preempted, self.config.max_num_batched_tokens)

    def apply(self, plan: StepPlan, outputs: Mapping[str, SeqOutput]) -> list[Delta]:
        """`record`, as one Delta per sequence."""
        return self.record(plan, outputs).as_deltas()

    def record(self, plan: StepPlan, outputs: Mapping[str, SeqOutput]) -> Recorded:
        """Record what the engine computed for `plan` and return what to stream. A sequence aborted
        since `schedule()` is skipped; a sampling chunk with no output ends its sequence with ERROR.
        An output the plan did not ask for (a model bug) raises ValueError before anything is recorded."""
        self._close_step(plan, outputs)
        out = Recorded([], [], [])
        ids, tokens, bs = out.ids, out.tokens, self.kv.block_size
        running = SeqStatus.RUNNING
        for chunk, seq in zip(plan.chunks, self._planned, strict=True):
            if seq.status is not running:  # aborted since the plan was made
                continue
            seq_id = seq.seq_id
            n = len(chunk.token_ids)
            computed = seq.num_computed = seq.num_computed + n
            got = outputs.get(seq_id)
            token, finish = (None, None) if got is None else (got.token, got.finish)
            output = seq.output
            if token is not None:
                output.append(token)
            elif chunk.samples and finish is None:
                finish = FinishReason.ERROR
            if seq.prompt_len + len(output) >= seq.named + bs:
                seq.extend_hashes(bs)  # a block of prompt + output is full: name it
            if n >= bs or computed % bs < n:  # the chunk filled a block: publish its name
                self.kv.publish_computed(seq_id, seq.block_hashes, computed)
            if finish is None and len(output) >= seq.max_tokens:
                finish = FinishReason.LENGTH
            if finish is not None:
                self._finish(seq, finish)
                out.deltas.append(Delta(seq_id, () if token is None else (token,), finish))
            elif token is not None:
                ids.append(seq_id)
                tokens.append(token)
        return out

    def _close_step(self, plan: StepPlan, outputs: Mapping[str, SeqOutput]) -> None:
        if plan is not self._outstanding:
            raise ValueError(f"plan of step {plan.step} is not the outstanding one")
        plan.check_outputs(outputs)
        self._outstanding = None
        self._steps += 1
        elapsed = self.clock.now() - self._scheduled_at
        self._step_s = 0.8 * self._step_s + 0.2 * elapsed if elapsed > 0 else self._step_s

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        elif self._waiting[seq.priority].remove(seq):
            if seq.status is SeqStatus.WAITING:
                self._waiting_new -= 1
                self._waiting_prompt_tokens -= len(seq.prompt)
        self.kv.free(seq.seq_id)
        seq.hold((), 0)
        seq.status = reason.status
        seq.finish_reason = reason
        self._ended[seq.status] += 1
        del self._seqs[seq.seq_id]

    # ---- observation ------------------------------------------------------------------------

    def _retry_after_s(self) -> float:
        steps = self._waiting_prompt_tokens / self.config.max_num_batched_tokens + 1
        return max(self.config.min_retry_after_s, steps * self._step_s)

    def statistics(self) -> SchedulerStatistics:
        pool = self.kv.pool.statistics()
        q = self._query_tokens
        return SchedulerStatistics(
            running=len(self._running),
            waiting=len(self._waiting[0]) + len(self._waiting[1]),
            waiting_prompt_tokens=self._waiting_prompt_tokens,
            kv_blocks_used=pool.used,
            kv_blocks_total=pool.num_blocks,
            kv_usage=pool.usage,
            prefix_hit_tokens=self._hit_tokens,
            prefix_query_tokens=q,
            prefix_hit_ratio=self._hit_tokens / q if q else 0.0,
            preemptions=self._preemptions,
            steps=self._steps,
            finished=self._ended[SeqStatus.FINISHED],
            aborted=self._ended[SeqStatus.ABORTED],
            errored=self._ended[SeqStatus.ERRORED],
        )
