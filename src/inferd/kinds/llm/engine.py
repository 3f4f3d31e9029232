"""The engine loop of an LLM worker: receive -> schedule -> run -> deliver -> idle, around LLMScheduler.

receive: apply the AddSequence / AbortSequence messages that arrived since the last step;
schedule: the scheduler's StepPlan;
run:      the model computes the plan in the device thread (the sim sleeps its cost model);
deliver:  one StepDeltas message with every sequence's new tokens and the scheduler's statistics;
idle:     with nothing live, wait for the next message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

from inferd.clock import Clock
from inferd.errors import ServingError
from inferd.kinds.llm.model import LLMModel, LLMRequest
from inferd.kinds.llm.plan import SchedulerConfig, SeqOutput, StepPlan
from inferd.kinds.llm.scheduler import LLMScheduler
from inferd.kinds.llm.sequence import FinishReason
from inferd.kinds.llm.static_scheduler import StaticBatchScheduler
from inferd.wire import protocol as p

log = logging.getLogger("inferd.llm.engine")


def scheduler_config(params: dict) -> SchedulerConfig:
    """The engine's budgets from the model's params (`params.scheduler` table)."""
    return SchedulerConfig(**params.get("scheduler", {}))


def new_scheduler(config: SchedulerConfig, clock: Clock) -> LLMScheduler:
    """The scheduler `config.policy` names: continuous batching, or the static baseline."""
    if config.policy == "static":
        return StaticBatchScheduler(config, clock)
    return LLMScheduler(config, clock)


class LLMEngine:
    def __init__(
        self,
        model: LLMModel,
        scheduler: LLMScheduler,
        send: Callable[[p.Message], None],
        flush: Callable[[], Awaitable[None]],
        executor: Executor,
    ) -> None:
        self.model = model
        self.scheduler = scheduler
        self.send = send
        self.flush = flush
        self.executor = executor
        self.requests: dict[str, LLMRequest] = {}
        self._inbox: deque[p.AddSequence | p.AbortSequence] = deque()
        self._wake = asyncio.Event()
        self._stopping: str | None = None

    # ---- called by the worker's receive loop ------------------------------------------------------
    def submit(self, msg: p.AddSequence | p.AbortSequence) -> None:
        self._inbox.append(msg)
        self._wake.set()

    def stop(self, finish_running: bool) -> None:
        """Drained: finish the live sequences, then return. Lost: abort them all now."""
        self._stopping = "drain" if finish_running else "lost"
        self._wake.set()

    # ---- the loop -------------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            notes = self.receive()
            if self._stopping == "lost":
                self._abort_all()
                return
            if not self.scheduler.has_work():
                if notes:
                    await self._deliver(notes, 0.0)
                if self._stopping == "drain":
                    return
                await self._idle()
                continue
            plan = self.scheduler.schedule()
            outputs, compute_s = await self._run(plan)
            self.post_step(plan, outputs, notes, compute_s)
            await self.flush()  # backpressure: a slow front end slows the engine, never grows a buffer

    # ---- the loop's synchronous steps (the fleet simulator drives them on a virtual clock) ---------
    def receive(self) -> list[p.SeqDelta]:
        """Apply queued messages; return refusals and aborts to report."""
        notes = []
        while self._inbox:
            msg = self._inbox.popleft()
            if isinstance(msg, p.AbortSequence):
                if self.scheduler.abort(msg.seq_id):
                    self._release(msg.seq_id)
                    notes.append(p.SeqDelta(msg.seq_id, finish_reason="abort"))
                continue
            prompt = tuple(msg.prompt)  # one copy, shared by the scheduler's Sequence and the request
            try:
                self.scheduler.add(
                    msg.seq_id, prompt, msg.max_tokens, msg.tenant, msg.priority, msg.output, msg.weight
                )
            except ServingError as exc:
                notes.append(p.SeqDelta(msg.seq_id, finish_reason="error", error=(exc.code, exc.message)))
                continue
            self.requests[msg.seq_id] = LLMRequest(
                msg.seq_id, prompt, msg.seed, msg.temperature, msg.top_p, msg.ignore_eos
            )
        return notes

    async def _run(self, plan: StepPlan) -> tuple[dict, float]:
        """The model's outputs for the plan. If the model raises, the step's sequences end with an
        error (their callers get an error event) and the engine goes on with everyone else."""
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            outputs = await loop.run_in_executor(self.executor, self.model.run_step, plan, self.requests)
        except Exception:
            log.exception("step %d failed; its %d sequence(s) end with an error", plan.step, len(plan.chunks))
            outputs = {c.seq_id: SeqOutput(finish=FinishReason.ERROR) for c in plan.chunks}
        return outputs, time.perf_counter() - start

    def post_step(self, plan: StepPlan, outputs: dict, notes: list[p.SeqDelta], compute_s: float) -> None:
        """The scheduler records the step's outputs; send them, after `notes` (from `receive`)."""
        rec = self.scheduler.record(plan, outputs)
        wire = p.SeqDelta
        for d in rec.deltas:
            notes.append(
                wire(d.seq_id, list(d.token_ids), None if d.finish_reason is None else d.finish_reason.value)
            )
        self.post(notes, compute_s, plan.admitted, plan.preempted, rec.ids, rec.tokens)

    def post(
        self,
        deltas: list[p.SeqDelta],
        compute_s: float,
        admitted: tuple[str, ...] = (),
        preempted: tuple[str, ...] = (),
        decoded_ids: list[str] | None = None,
        decoded_tokens: list[int] | None = None,
    ) -> None:
        """Release the sequences that ended and send the step's StepDeltas."""
        for d in deltas:
            if d.finish_reason is not None:
                self._release(d.seq_id)
        stats = self._stats()
        self.send(
            p.StepDeltas(
                compute_s,
                deltas,
                stats,
                list(admitted),
                list(preempted),
                decoded_ids or [],
                decoded_tokens or [],
            )
        )

    async def _deliver(self, deltas: list[p.SeqDelta], compute_s: float) -> None:
        self.post(deltas, compute_s)
        await self.flush()  # backpressure: a slow front end slows the engine, never grows a buffer

    async def _idle(self) -> None:
        self._wake.clear()
        if not self._inbox and self._stopping is None:
            await self._wake.wait()

    # ---- helpers --------------------------------------------------------------------------------------
    def _release(self, seq_id: str) -> None:
        self.requests.pop(seq_id, None)
        self.model.release(seq_id)

    def _abort_all(self) -> None:
        for seq_id in [*self.scheduler.running_ids(), *self.scheduler.waiting_ids()]:
            self.scheduler.abort(seq_id)
            self._release(seq_id)
        log.info("front end gone: aborted every live sequence")

    def _stats(self) -> p.LLMStats:
        s = self.scheduler.statistics()
        return p.LLMStats(
            running=s.running,
            waiting=s.waiting,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total,
            preemptions=s.preemptions,
            steps=s.steps,
            finished=s.finished,
            aborted=s.aborted,
            errored=s.errored,
            prefix_hit_tokens=s.prefix_hit_tokens,
            prefix_query_tokens=s.prefix_query_tokens,
        )
