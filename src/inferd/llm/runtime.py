"""The front end's driver of one LLM model: its workers (each runs an engine), one token stream per
request, and aborts when a client goes away.

submit (tokenized request -> least-loaded worker) -> on_step (deltas into each request's stream)
                                                  -> abort (client gone) / on_worker_lost (fail streams)
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from inferd.batching.queue import INTERACTIVE
from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.errors import BadRequest, Overloaded, ServingError, WorkerDied, WorkerUnavailable, from_wire
from inferd.llm.model import Tokenizer, tokenizer_for
from inferd.llm.stream import TokenStream
from inferd.observability.metrics import LLMMetrics
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
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    priority: int = INTERACTIVE
    tenant: str = ""
    """The prefix-cache salt (X-Tenant until the gateway authenticates callers)."""


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
    prefix_hit_tokens: int
    """Prompt tokens the engines found in their prefix caches (hit / query is the hit ratio)."""
    prefix_query_tokens: int


class LLMRuntime:
    def __init__(self, config: ModelConfig, clock: Clock, metrics: LLMMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.name = config.name
        self.clock = clock
        self.tokenizer: Tokenizer = tokenizer_for(config)
        self.max_model_len = int(config.params.get("max_model_len", 2048))
        self.workers: list[WorkerConnection] = []
        self.streams: dict[str, TokenStream] = {}
        self._live: dict[str, int] = {}
        """Live sequences per worker id: the load the balancer compares."""
        self._stats: dict[str, p.LLMStats] = {}
        self.client_aborts = 0
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
        """Start a sequence on the least-loaded ready worker. Raises WorkerUnavailable."""
        if self._stopping:
            raise WorkerUnavailable(f"model '{self.name}' is shutting down")
        ready = [w for w in self.workers if w.state is WorkerState.READY]
        if not ready:
            raise WorkerUnavailable(f"model '{self.name}' has no ready worker; retry shortly")
        worker = min(ready, key=lambda w: self._live.get(w.worker_id, 0))
        seq_id = f"{self.name}-{next(_seq_ids)}"
        stream = TokenStream(seq_id, worker.worker_id, len(prompt))
        stream.submitted_at = stream.last_token_at = self.clock.now()
        if self.metrics is not None:
            self.metrics.submitted(len(prompt))
        self.streams[seq_id] = stream
        self._live[worker.worker_id] = self._live.get(worker.worker_id, 0) + 1
        worker.send(
            p.AddSequence(
                seq_id,
                prompt,
                gen.max_tokens,
                gen.seed,
                gen.priority,
                gen.tenant,
                gen.temperature,
                gen.top_p,
            )
        )
        return stream

    def abort(self, stream: TokenStream, client_gone: bool = True) -> None:
        """End the sequence in the engine now: the client left (or the text reached a stop string).
        A no-op once the engine has ended it."""
        if self.streams.pop(stream.seq_id, None) is None:
            return
        self._ended(stream)
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
        self._stats[worker.worker_id] = msg.stats
        for delta in msg.deltas:
            stream = self.streams.get(delta.seq_id)
            if stream is None:  # its client left
                continue
            if delta.error is not None:
                stream.fail(self._error(*delta.error))
            else:
                self._observe_tokens(stream, len(delta.token_ids), now, delta.finish_reason is not None)
                stream.push(delta.token_ids, delta.finish_reason)
            if stream.ended:
                del self.streams[delta.seq_id]
                self._ended(stream)

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

    def _ended(self, stream: TokenStream) -> None:
        self._live[stream.worker_id] = max(0, self._live.get(stream.worker_id, 0) - 1)

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
        self._live.pop(worker.worker_id, None)
        self._stats.pop(worker.worker_id, None)
        for seq_id, stream in list(self.streams.items()):
            if stream.worker_id == worker.worker_id:
                del self.streams[seq_id]
                stream.fail(
                    WorkerDied(f"worker {worker.worker_id} of model '{self.name}' went away: {reason}")
                )
        log.warning("LLM worker %s of model %s lost: %s", worker.worker_id, self.name, reason)

    def stop_accepting(self) -> None:
        self._stopping = True

    def fail_all(self, exc: ServingError) -> None:
        for stream in self.streams.values():
            stream.fail(exc)
        self.streams.clear()

    # ---- stats ------------------------------------------------------------------------------------
    def statistics(self) -> LLMRuntimeStatistics:
        stats = list(self._stats.values())

        def total(field: str) -> int:
            return sum(getattr(s, field) for s in stats)

        return LLMRuntimeStatistics(
            workers=len(self.workers),
            streams=len(self.streams),
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
            prefix_hit_tokens=total("prefix_hit_tokens"),
            prefix_query_tokens=total("prefix_query_tokens"),
        )
