"""The front end's driver of one LLM model (kind "llm" of inferd.runtime.contract): its workers (each runs
an engine), one token stream per request, aborts, deadlines, failover and the hang watchdog.

service:        LlmService (kinds/llm/service.py): what an edge calls: check, tokenize, admit, submit
                every choice, its text with stop strings applied, and the aborts at its end
hold:           no worker in service: the request waits for one its waker starts (kinds/llm/cold.py)
submit:         placement (inferd.kinds.llm.placement: routing + admission) -> AddSequence to the chosen worker
on_message:     a step's deltas into each request's stream; admissions counted off
abort:          the client left (or a stop string matched): AbortSequence to the worker
run:            every WATCHDOG_INTERVAL_S: a stream past its deadline fails with DeadlineExceeded and its
                sequence is aborted in the engine (its KV blocks freed); a hung or silent worker
                (inferd.kinds.llm.watchdog) is killed through `kill_worker`, and its broken connection moves
                its streams (on_worker_lost)
on_worker_lost: failover (Placement.move): each stream resumes on another worker
drain_worker:   the worker takes no new sequences; it finishes its live ones, then exits
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import ClassVar

from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.errors import (
    DeadlineExceeded,
    Overloaded,
    ServingError,
    WorkerUnavailable,
    from_wire,
)
from inferd.kinds.llm.cold import ColdHold
from inferd.kinds.llm.model import Tokenizer, tokenizer_for
from inferd.kinds.llm.params import llm_params
from inferd.kinds.llm.placement import Generation, Live, Load, Placement
from inferd.kinds.llm.routing import PrefixAffinityRouter
from inferd.kinds.llm.service import LlmService
from inferd.kinds.llm.statistics import LLMRuntimeStatistics, LLMWorkerStatistics, TTFTWindow
from inferd.kinds.llm.stream import TokenStream
from inferd.kinds.llm.watchdog import HangPolicy, WorkerProgress
from inferd.observability import tracing
from inferd.observability.metrics import LLMMetrics
from inferd.routing.locality import LocalityPolicy
from inferd.routing.retry import RetryBudget
from inferd.runtime.contract import RuntimeStatistics, WorkerSnapshot
from inferd.runtime.membership import Membership
from inferd.runtime.waking import Wakers
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState

log = logging.getLogger("inferd.llm")

_seq_ids = itertools.count(1)
WATCHDOG_INTERVAL_S = 0.1

KillWorker = Callable[[WorkerConnection], None]


class LLMRuntime:
    kind: ClassVar[str] = "llm"
    accepts_workers: ClassVar[bool] = True

    def __init__(
        self,
        config: ModelConfig,
        clock: Clock,
        metrics: LLMMetrics | None = None,
        retry_budget: RetryBudget | None = None,
        *,
        kill_worker: KillWorker,
        heartbeat_timeout_s: float = 5.0,
        members: Membership | None = None,
        locality: LocalityPolicy | None = None,
        wakers: Wakers | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.clock = clock
        self.metrics = metrics
        self.kill_worker = kill_worker
        """Kills a hung or silent worker (the server's: SIGKILL a local child, drop a remote one)."""
        self.tokenizer: Tokenizer = tokenizer_for(config)
        params = llm_params(config)
        self.max_model_len = params.max_model_len
        self.scheduler_config = params.scheduler
        self.router = PrefixAffinityRouter(params.routing, self.scheduler_config, clock)
        self.retry_budget = retry_budget or RetryBudget(clock)
        """Shared with the batch models (the server's), so failovers cannot multiply load."""
        self.members = members or Membership(clock)
        """Its workers (runtime/membership.py: join, drain, loss, the change event), the server's
        WorkerDirectory's for this version; a runtime built alone (tests, fleetsim) has its own."""
        self.workers = self.members.workers
        self.placement = Placement(
            self.name, self.workers, self.scheduler_config, self.router, self.retry_budget, clock, locality
        )
        self.locality = locality
        self.hang = HangPolicy(clock, params.hang_timeout_s, heartbeat_timeout_s)
        s = self.scheduler_config
        self.cold = ColdHold(
            lambda: self.config, clock, wakers, self.ready_workers, s.max_waiting_seqs, s.max_num_seqs, metrics
        )
        """No worker in service: requests wait while the model's waker starts one (kinds/llm/cold.py)."""
        self.ttft = TTFTWindow(clock)
        self._stats: dict[str, p.LLMStats] = {}
        self.client_aborts = 0
        self.deadline_aborts = 0
        self.hung_workers = 0
        self.service = LlmService(self)  # how callers generate text (kinds/llm/service.py)

    @property
    def version(self) -> int:
        return self.config.version

    @property
    def ready(self) -> bool:
        """A ready worker; with none, whether its waker can start one on demand (runtime/readiness.py)."""
        if self.placement.stopping:
            return False
        return self.ready_workers() > 0 or self.cold.on_demand()

    def ready_workers(self) -> int:
        return sum(1 for w in self.workers if w.state is WorkerState.READY and not w.failure)

    # ---- receive ----------------------------------------------------------------------------------
    async def hold(self, n: int, deadline: float | None) -> None:
        """Wait for a worker in service (at once when one is), or raise why the `n` sequences cannot wait
        (again if the one that came was lost before they were placed)."""
        while not self.placement.stopping and self.ready_workers() == 0:
            await self.cold.wait(n, deadline)

    def submit(self, prompt: list[int], gen: Generation) -> TokenStream:
        """Start a sequence on the worker routing picks. Raises WorkerUnavailable (none ready) or
        Overloaded (no ready worker's queue has room) before anything is sent."""
        hashes = self.router.block_hashes(prompt, gen.tenant)
        try:
            worker = self.placement.choose(len(prompt), hashes, gen)
        except Overloaded:
            self.placement.rejected += 1
            raise
        stream = TokenStream(f"{self.name}-{next(_seq_ids)}", worker.worker_id, len(prompt))
        stream.submitted_at = stream.last_token_at = self.clock.now()
        stream.trace = tracing.recording_span() if tracing.ENABLED else None
        if self.metrics is not None:
            self.metrics.submitted(len(prompt))
        self.placement.start(Live(stream, prompt, gen, hashes), worker)
        return stream

    def abort(self, stream: TokenStream, client_gone: bool = True) -> None:
        """End the sequence in the engine now: the client left (or the text reached a stop string).
        A no-op once the engine has ended it."""
        live = self.placement.live.get(stream.seq_id)
        if live is None:
            return
        if stream.ended:
            self.placement.end(live)
            return
        self._cancel(live, WorkerUnavailable(f"sequence {stream.seq_id} was aborted"))
        self.client_aborts += client_gone

    def _cancel(self, live: Live, exc: ServingError) -> None:
        """End the stream with `exc` and abort its sequence in its engine (which frees its KV blocks)."""
        self.placement.end(live)
        live.stream.fail(exc)
        for w in self.workers:
            if w.worker_id == live.stream.worker_id:
                w.send(p.AbortSequence(live.stream.seq_id))

    # ---- deliver ----------------------------------------------------------------------------------
    def on_message(self, worker: WorkerConnection, msg: p.Message) -> None:
        """A worker's result (heartbeats are the hub's)."""
        if isinstance(msg, p.StepDeltas):
            self.on_step(worker, msg)
        elif isinstance(msg, p.BatchDone):
            log.warning("LLM worker %s answered a batch %d; ignored", worker.worker_id, msg.batch_id)

    def on_step(self, worker: WorkerConnection, msg: p.StepDeltas) -> None:
        now = self.clock.now()
        worker.last_progress = worker.last_heartbeat = now
        worker.completed_batches += 1
        worker.busy_s += msg.compute_s
        if msg.compute_s > 0:
            self.placement.step_s = 0.8 * self.placement.step_s + 0.2 * msg.compute_s
        self.hang.observe_step(msg.compute_s)
        self._stats[worker.worker_id] = msg.stats
        live_table = self.placement.live
        for seq_id in msg.admitted:
            live = live_table.get(seq_id)
            if live is not None and live.stream.worker_id == worker.worker_id:
                self.placement.admitted(live)
        for seq_id in msg.preempted:  # traced requests get a "preempted" event (KV freed, recomputed later)
            live = live_table.get(seq_id)
            if live is not None and live.stream.trace is not None:
                tracing.event(live.stream.trace, "preempted", {"worker_id": worker.worker_id})
        wid, placement, metrics = worker.worker_id, self.placement, self.metrics
        observe, streamed = metrics is not None, 0
        for seq_id, token in zip(msg.decoded_ids, msg.decoded_tokens, strict=True):  # one token, goes on
            live = live_table.get(seq_id)
            if live is None or (stream := live.stream).worker_id != wid:
                continue
            if live.waiting:
                placement.admitted(live)
            if observe or stream.trace is not None or not stream.completion_tokens:
                self._observe_tokens(stream, 1, now, False)
            stream.push_token(token)
            streamed += 1
        for delta in msg.deltas:
            live = live_table.get(delta.seq_id)
            if live is None or live.stream.worker_id != worker.worker_id:  # client left, or moved
                continue
            self.placement.admitted(live)  # a token or an end: it has left the waiting queue
            stream = live.stream
            if delta.error is not None:
                stream.fail(self._error(*delta.error))
            else:
                self._observe_tokens(stream, len(delta.token_ids), now, delta.finish_reason is not None)
                stream.push(delta.token_ids, delta.finish_reason)
                streamed += len(delta.token_ids)
            if stream.ended:
                self.placement.end(live)
        if metrics is not None and streamed:
            metrics.generated(streamed)

    def _observe_tokens(self, stream: TokenStream, n: int, now: float, last: bool) -> None:
        first = n > 0 and stream.completion_tokens == 0
        if stream.trace is not None:
            tracing.stream_events(stream.trace, stream.worker_id, first, last, stream.completion_tokens + n)
        if first:
            self.ttft.observe(now - stream.submitted_at)
        if self.metrics is None:
            return
        if n:
            self.metrics.tokens(n, now - stream.last_token_at, first=first)
            stream.last_token_at = now
        if last:
            self.metrics.finished(now - stream.submitted_at)

    def _error(self, code: str, message: str) -> ServingError:
        if code in ("SchedulerFull", "Overloaded"):
            return Overloaded(message, 1.0, reason="llm_queue_full")
        return from_wire(code, message)

    # ---- the watchdog -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Until cancelled: expire deadlines and kill hung or silent workers."""
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            self.expire_deadlines()
            self.check_workers()
            self.cold.rewake()

    def expire_deadlines(self) -> None:
        for live in self.placement.expired():
            timeout_ms = (live.gen.deadline or 0.0) - live.stream.submitted_at
            self.deadline_aborts += 1
            self._cancel(
                live,
                DeadlineExceeded(
                    f"sequence {live.stream.seq_id} of model '{self.name}' ran past its deadline "
                    f"({timeout_ms * 1000:.0f} ms) after {live.stream.completion_tokens} tokens"
                ),
            )

    def check_workers(self) -> None:
        for w in list(self.workers):
            if w.failure:
                continue
            load = self.placement.loads.get(w.worker_id) or Load()
            w.failure = self.hang.verdict(
                WorkerProgress(load.live, load.busy_since, w.last_progress, w.last_heartbeat)
            )
            if not w.failure:
                continue
            self.hung_workers += 1
            log.warning(
                "killing LLM worker %s (pid %d) of model %s: %s", w.worker_id, w.pid, self.name, w.failure
            )
            self.kill_worker(w)

    # ---- workers ----------------------------------------------------------------------------------
    def add_worker(self, worker: WorkerConnection) -> None:
        self.members.add(worker)
        if self.locality is not None:
            self.locality.join(worker.worker_id, worker.zone)
        self.cold.served()
        log.info("LLM worker %s (pid %d) of model %s is ready", worker.worker_id, worker.pid, self.name)

    def drain_worker(self, worker: WorkerConnection) -> None:
        """No new sequences for it; its engine finishes the live ones, then the worker exits."""
        if self.members.drain(worker):
            if self.locality is not None:
                self.locality.leave(worker.worker_id)
            log.info(
                "draining LLM worker %s (pid %d) of model %s: %d live sequence(s) to finish",
                worker.worker_id,
                worker.pid,
                self.name,
                self.placement.live_on(worker.worker_id),
            )

    def on_worker_lost(self, worker: WorkerConnection, reason: str) -> None:
        was = self.members.lose(worker)
        if self.locality is not None:  # a lost worker's zone still expects it for a while; a drained one's not
            (self.locality.lose if was is WorkerState.READY else self.locality.leave)(worker.worker_id)
        self._stats.pop(worker.worker_id, None)
        orphans = self.placement.forget(worker)
        log.warning(
            "LLM worker %s of model %s lost (%s); moving its %d streams",
            worker.worker_id,
            self.name,
            reason,
            len(orphans),
        )
        for live in orphans:
            self.placement.move(live, f"worker {worker.worker_id} of model '{self.name}' went away: {reason}")

    def live_on(self, worker_id: str) -> int:
        """Sequences placed on the worker whose end the front end has not yet seen."""
        return self.placement.live_on(worker_id)

    # ---- lifecycle and stats ----------------------------------------------------------------------
    def stop(self, exc: ServingError) -> None:
        """Refuse new sequences and end every open stream with `exc` (server shutdown)."""
        self.placement.stopping = True
        self.cold.fail(exc)
        for live in self.placement.live.values():
            live.stream.fail(exc)
        self.placement.live.clear()

    def statistics(self) -> RuntimeStatistics:
        workers = tuple(self._snapshot(w) for w in self.workers)
        placed = sum(load.waiting for load in self.placement.loads.values())  # sent, not yet admitted
        return RuntimeStatistics(
            name=self.name,
            version=self.version,
            kind=self.kind,
            ready=self.ready,
            workers=workers,
            ready_workers=self.ready_workers(),
            queued=placed + self.cold.held,  # held: waiting for a worker to start (kinds/llm/cold.py)
            in_flight=len(self.placement.live) - placed,
            detail=self._detail(),
            locality=self.placement.zones(),
        )

    def _snapshot(self, w: WorkerConnection) -> WorkerSnapshot:
        s = self._stats.get(w.worker_id, p.LLMStats())
        load = self.placement.loads.get(w.worker_id) or Load()
        detail = LLMWorkerStatistics(
            running=s.running,
            waiting=s.waiting,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total,
            preemptions=s.preemptions,
            unadmitted=load.waiting,
            failure=w.failure,
        )
        return WorkerSnapshot.of(w, load.live, detail)

    def _detail(self) -> LLMRuntimeStatistics:
        stats = list(self._stats.values())

        def total(field: str) -> int:
            return sum(getattr(s, field) for s in stats)

        ttft_p90, ttft_samples = self.ttft.p90()
        placement = self.placement
        return LLMRuntimeStatistics(
            workers=len(self.workers),
            streams=len(placement.live),
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
            rejected=placement.rejected,
            moved=placement.moved,
            lost=placement.lost,
            prefix_hit_tokens=total("prefix_hit_tokens"),
            prefix_query_tokens=total("prefix_query_tokens"),
            deadline_aborts=self.deadline_aborts,
            hung_workers=self.hung_workers,
            ttft_s=ttft_p90,
            ttft_samples=ttft_samples,
            hang_timeout_s=self.hang.timeout_s(),
            held=self.cold.held,
            cold_for_s=self.cold.held_for_s(),
        )
