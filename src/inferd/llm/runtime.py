"""The front end's driver of one LLM model: its workers (each runs an engine), one token stream per
request, aborts when a client goes away, and failover when a worker dies.

submit: admission + routing -> AddSequence to the chosen worker
    routing (inferd.llm.routing): the ready worker with the longest recently-sent prompt prefix (same
    block names and tenant salt as its prefix cache), within a hard load cap over the least-loaded
    ready worker; otherwise the least-loaded.
    admission (overload, RELIABILITY L6): each worker's engine bounds its waiting queue
    (`params.scheduler.max_waiting_seqs`, `max_waiting_prompt_tokens`). The front end counts, per
    worker, what it has sent and not yet seen admitted (StepDeltas.admitted, or a first delta), so it
    refuses with Overloaded (429 + Retry-After, before any response starts) exactly when no ready
    worker's engine would queue the sequence: together, the bounds summed over the ready workers.
    Running streams are untouched by refusals.
on_step: deltas into each request's stream; admissions counted off.
abort: the client left (or a stop string matched): AbortSequence to the worker.
on_worker_lost: failover, which resumes rather than fails. Each stream of the dead worker goes to
    another ready worker (same routing and admission): one that had not received a token is simply
    submitted again; one that had is resumed from prompt + the tokens the client already has
    (AddSequence.output), so the new engine continues the same sequence and the client sees no
    duplicated and no missing token. Each move spends one retry from the server's RetryBudget. With no
    ready worker with room, or the budget spent, the stream ends with WorkerDied: an SSE error event
    (then [DONE]) if it had started, a 503 if not.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from inferd.batching.queue import INTERACTIVE
from inferd.batching.retry import RetryBudget
from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.errors import BadRequest, Overloaded, ServingError, WorkerDied, WorkerUnavailable, from_wire
from inferd.llm.kv import BlockHash
from inferd.llm.model import Tokenizer, tokenizer_for
from inferd.llm.plan import SchedulerConfig
from inferd.llm.routing import PrefixAffinityRouter, RoutingConfig, WorkerLoad
from inferd.llm.stream import TokenStream
from inferd.observability.metrics import LLMMetrics
from inferd.routing.health import Health
from inferd.worker import protocol as p
from inferd.worker.connection import WorkerConnection, WorkerState

log = logging.getLogger("inferd.llm")

_seq_ids = itertools.count(1)


class ContextLengthExceeded(BadRequest):
    """Prompt plus max_tokens exceed the model's context (OpenAI code `context_length_exceeded`)."""

    @property
    def code(self) -> str:
        return "context_length_exceeded"


@dataclass(frozen=True, slots=True)
class Generation:
    """How to generate one sequence: what the API request asked for, validated."""

    max_tokens: int
    seed: int | None = None
    """None: the backend draws its own (sim-llm uses 0)."""
    temperature: float = 1.0
    top_p: float = 1.0
    priority: int = INTERACTIVE
    tenant: str = ""
    """The prefix-cache salt (X-Tenant until the gateway authenticates callers)."""
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class LLMRuntimeStatistics:
    """Summed over the model's workers (as of each worker's last step), plus front-end counts."""

    workers: int
    streams: int
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    steps: int
    finished: int
    aborted: int
    errored: int
    client_aborts: int
    rejected: int
    """Requests refused with Overloaded at admission (no ready worker's queue had room)."""
    moved: int
    """Streams placed on another worker after theirs died (resubmitted or resumed)."""
    lost: int
    """Streams ended with WorkerDied: their worker died and no worker or retry budget was left."""
    prefix_hit_tokens: int
    """Prompt tokens the engines found in their prefix caches (hit / query is the hit ratio)."""
    prefix_query_tokens: int


@dataclass(slots=True, eq=False)
class _Live:
    """A sequence placed on a worker whose end the front end has not yet seen."""

    stream: TokenStream
    prompt: list[int]
    gen: Generation
    hashes: list[BlockHash]
    """Its prompt's block names, for routing (again, on failover)."""
    waiting: bool = False
    """Sent to its worker, not yet admitted there: counted against that worker's waiting bounds."""
    moves: int = 0
    """Times it was placed again after its worker died."""


@dataclass(slots=True)
class _Load:
    """What the front end has placed on one worker."""

    live: int = 0
    waiting: int = 0
    waiting_prompt_tokens: int = 0


class LLMRuntime:
    def __init__(
        self,
        config: ModelConfig,
        clock: Clock,
        metrics: LLMMetrics | None = None,
        retry_budget: RetryBudget | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.name = config.name
        self.clock = clock
        self.tokenizer: Tokenizer = tokenizer_for(config)
        self.max_model_len = int(config.params.get("max_model_len", 2048))
        self.scheduler_config = SchedulerConfig(**config.params.get("scheduler", {}))
        self.router = PrefixAffinityRouter(
            RoutingConfig(**config.params.get("routing", {})), self.scheduler_config, clock
        )
        self.retry_budget = retry_budget or RetryBudget(clock)
        """Shared with the batch models (the server's), so failovers cannot multiply load."""
        self.workers: list[WorkerConnection] = []
        self._live: dict[str, _Live] = {}
        self._loads: dict[str, _Load] = {}
        self._stats: dict[str, p.LLMStats] = {}
        self._step_s = self.scheduler_config.initial_step_s
        """EWMA of the workers' step times, for Retry-After hints."""
        self.client_aborts = 0
        self.rejected = 0
        self.moved = 0
        self.lost = 0
        """Streams ended because their worker died and they could not be moved."""
        self._stopping = False

    @property
    def ready(self) -> bool:
        return not self._stopping and any(w.state is WorkerState.READY for w in self.workers)

    @property
    def served_version(self) -> int:
        return self.config.version

    # ---- receive ----------------------------------------------------------------------------------
    def check_context(self, prompt_tokens: int, max_tokens: int, what: str) -> None:
        total = prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({prompt_tokens} in the {what}, {max_tokens} in the "
                "completion). Please reduce the length of the "
                f"{what} or completion."
            )

    def submit(self, prompt: list[int], gen: Generation) -> TokenStream:
        """Start a sequence on the worker routing picks. Raises WorkerUnavailable (none ready) or
        Overloaded (no ready worker's queue has room) before anything is sent."""
        hashes = self.router.block_hashes(prompt, gen.tenant)
        try:
            worker = self._choose(len(prompt), hashes)
        except Overloaded:
            self.rejected += 1
            raise
        stream = TokenStream(f"{self.name}-{next(_seq_ids)}", worker.worker_id, len(prompt))
        stream.submitted_at = stream.last_token_at = self.clock.now()
        if self.metrics is not None:
            self.metrics.submitted(len(prompt))
        live = _Live(stream, prompt, gen, hashes)
        self._live[stream.seq_id] = live
        self.retry_budget.record_requests(1)
        self._place(live, worker)
        return stream

    def _choose(self, prompt_tokens: int, hashes: list[BlockHash]) -> WorkerConnection:
        if self._stopping:
            raise WorkerUnavailable(f"model '{self.name}' is shutting down")
        ready = [w for w in self.workers if w.state is WorkerState.READY]
        if not ready:
            raise WorkerUnavailable(f"model '{self.name}' has no ready worker; retry shortly")
        choice = self.router.pick([self._view(w) for w in ready], hashes, prompt_tokens)
        if choice is None:
            s = self.scheduler_config
            raise Overloaded(
                f"model '{self.name}' is full: no ready worker (of {len(ready)}) can queue a sequence of "
                f"{prompt_tokens} prompt tokens (max_waiting_seqs={s.max_waiting_seqs}, "
                f"max_waiting_prompt_tokens={s.max_waiting_prompt_tokens} per worker)",
                self._retry_after_s(),
                reason="llm_queue_full",
            )
        return next(w for w in ready if w.worker_id == choice.worker_id)

    def _view(self, worker: WorkerConnection) -> WorkerLoad:
        load = self._loads.get(worker.worker_id, _Load())
        routable = worker.state is WorkerState.READY  # starting, draining or dead: not routable
        health = Health.READY if routable else Health.DRAINING
        return WorkerLoad(worker.worker_id, health, load.live, load.waiting, load.waiting_prompt_tokens)

    def _place(self, live: _Live, worker: WorkerConnection) -> None:
        """Send the sequence to `worker`, resuming after the tokens its stream already holds."""
        live.stream.worker_id = worker.worker_id
        live.waiting = True
        load = self._loads.setdefault(worker.worker_id, _Load())
        load.live += 1
        load.waiting += 1
        load.waiting_prompt_tokens += len(live.prompt)
        self.router.record(worker.worker_id, live.hashes)
        g = live.gen
        worker.send(
            p.AddSequence(
                live.stream.seq_id,
                live.prompt,
                g.max_tokens,
                g.seed,
                g.priority,
                g.tenant,
                g.temperature,
                g.top_p,
                g.ignore_eos,
                output=list(live.stream.generated),
            )
        )

    def _retry_after_s(self) -> float:
        """The engines' hint: the steps to prefill the least-queued worker's waiting prompts."""
        s = self.scheduler_config
        queued = min((load.waiting_prompt_tokens for load in self._loads.values()), default=0)
        return max(s.min_retry_after_s, (queued / s.max_num_batched_tokens + 1) * self._step_s)

    def abort(self, stream: TokenStream, client_gone: bool = True) -> None:
        """End the sequence in the engine now: the client left (or the text reached a stop string).
        A no-op once the engine has ended it."""
        live = self._live.get(stream.seq_id)
        if live is None:
            return
        self._end(live)
        if stream.ended:
            return
        stream.fail(WorkerUnavailable(f"sequence {stream.seq_id} was aborted"))
        self.client_aborts += client_gone
        for w in self.workers:
            if w.worker_id == stream.worker_id:
                w.send(p.AbortSequence(stream.seq_id))

    # ---- deliver ----------------------------------------------------------------------------------
    def on_step(self, worker: WorkerConnection, msg: p.StepDeltas) -> None:
        now = self.clock.now()
        worker.last_progress = worker.last_heartbeat = now
        worker.completed_batches += 1
        worker.busy_s += msg.compute_s
        if msg.compute_s > 0:
            self._step_s = 0.8 * self._step_s + 0.2 * msg.compute_s
        self._stats[worker.worker_id] = msg.stats
        for seq_id in msg.admitted:
            live = self._live.get(seq_id)
            if live is not None and live.stream.worker_id == worker.worker_id:
                self._admitted(live)
        for delta in msg.deltas:
            live = self._live.get(delta.seq_id)
            if live is None or live.stream.worker_id != worker.worker_id:  # client left, or moved
                continue
            self._admitted(live)  # a token or an end: it has left the waiting queue
            stream = live.stream
            if delta.error is not None:
                stream.fail(self._error(*delta.error))
            else:
                self._observe_tokens(stream, len(delta.token_ids), now, delta.finish_reason is not None)
                stream.push(delta.token_ids, delta.finish_reason)
            if stream.ended:
                self._end(live)

    def _observe_tokens(self, stream: TokenStream, n: int, now: float, last: bool) -> None:
        if self.metrics is None:
            return
        if n:
            self.metrics.tokens(n, now - stream.last_token_at, first=stream.completion_tokens == 0)
            stream.last_token_at = now
        if last:
            self.metrics.finished(now - stream.submitted_at)

    def on_batch_done(self, worker: WorkerConnection, msg: p.BatchDone) -> None:
        log.warning("LLM worker %s answered a batch %d; ignored", worker.worker_id, msg.batch_id)

    def _error(self, code: str, message: str) -> ServingError:
        if code in ("SchedulerFull", "Overloaded"):
            return Overloaded(message, 1.0, reason="llm_queue_full")
        return from_wire(code, message)

    def _admitted(self, live: _Live) -> None:
        if not live.waiting:
            return
        live.waiting = False
        load = self._loads.get(live.stream.worker_id)
        if load is not None:
            load.waiting -= 1
            load.waiting_prompt_tokens -= len(live.prompt)

    def _end(self, live: _Live) -> None:
        self._admitted(live)
        del self._live[live.stream.seq_id]
        load = self._loads.get(live.stream.worker_id)
        if load is not None:
            load.live -= 1

    # ---- workers ----------------------------------------------------------------------------------
    def add_worker(self, worker: WorkerConnection) -> None:
        worker.state = WorkerState.READY
        worker.last_progress = worker.last_heartbeat = self.clock.now()
        self.workers.append(worker)
        log.info("LLM worker %s (pid %d) of model %s is ready", worker.worker_id, worker.pid, self.name)

    def on_worker_lost(self, worker: WorkerConnection, reason: str) -> None:
        worker.state = WorkerState.DEAD
        if worker in self.workers:
            self.workers.remove(worker)
        self._loads.pop(worker.worker_id, None)
        self._stats.pop(worker.worker_id, None)
        self.router.forget(worker.worker_id)
        orphans = [live for live in self._live.values() if live.stream.worker_id == worker.worker_id]
        log.warning(
            "LLM worker %s of model %s lost (%s); moving its %d streams",
            worker.worker_id,
            self.name,
            reason,
            len(orphans),
        )
        for live in orphans:
            self._move(live, f"worker {worker.worker_id} of model '{self.name}' went away: {reason}")

    def _move(self, live: _Live, why: str) -> None:
        """Place an orphaned sequence on another worker (resuming it), or end its stream with WorkerDied."""
        live.waiting = False  # its dead worker's counts are gone with it
        try:
            target = self._choose(len(live.prompt), live.hashes)
        except ServingError as exc:
            self._give_up(live, f"{why}; it could not be moved: {exc.message}")
            return
        if not self.retry_budget.try_spend(1):
            self._give_up(live, f"{why}; the retry budget is spent, so it was not moved")
            return
        live.moves += 1
        self.moved += 1
        log.debug(
            "sequence %s moved to %s after %d tokens",
            live.stream.seq_id,
            target.worker_id,
            len(live.stream.generated),
        )
        self._place(live, target)

    def _give_up(self, live: _Live, message: str) -> None:
        del self._live[live.stream.seq_id]
        self.lost += 1
        live.stream.fail(WorkerDied(message))

    def stop_accepting(self) -> None:
        self._stopping = True

    def fail_all(self, exc: ServingError) -> None:
        for live in self._live.values():
            live.stream.fail(exc)
        self._live.clear()

    def live_on(self, worker_id: str) -> int:
        """Sequences placed on the worker whose end the front end has not yet seen."""
        load = self._loads.get(worker_id)
        return 0 if load is None else load.live

    # ---- stats ------------------------------------------------------------------------------------
    def statistics(self) -> LLMRuntimeStatistics:
        stats = list(self._stats.values())

        def total(field: str) -> int:
            return sum(getattr(s, field) for s in stats)

        return LLMRuntimeStatistics(
            workers=len(self.workers),
            streams=len(self._live),
            running=total("running"),
            waiting=total("waiting"),
            kv_blocks_used=total("kv_blocks_used"),
            kv_blocks_total=total("kv_blocks_total"),
            preemptions=total("preemptions"),
            steps=total("steps"),
            finished=total("finished"),
            aborted=total("aborted"),
            errored=total("errored"),
            client_aborts=self.client_aborts,
            rejected=self.rejected,
            moved=self.moved,
            lost=self.lost,
            prefix_hit_tokens=total("prefix_hit_tokens"),
            prefix_query_tokens=total("prefix_query_tokens"),
        )
