"""Where the live sequences of one LLM model run: choosing a worker (routing + admission), placing a
sequence there (AddSequence), the per-worker counts admission needs, deadlines, and failover moves.

choose: the ready worker routing (inferd.kinds.llm.routing) picks among those whose engine would queue the
    sequence, within the zone that zone routing (routing/locality.py) gives first, then the others in its
    order (a zone whose workers have no room spills to the next rather than refuse): each engine bounds its waiting queue (`params.scheduler.max_waiting_seqs`,
    `max_waiting_prompt_tokens`); the front end counts, per worker, what it has sent and not yet seen
    admitted (StepDeltas.admitted, or a first delta), so it refuses with Overloaded (429 + Retry-After,
    before any response starts) exactly when no ready worker's engine would queue the sequence.
move: failover, which resumes rather than fails. A stream of a lost worker goes to another ready worker
    (same routing and admission): one that had not received a token is simply submitted again; one that
    had is resumed from prompt + the tokens the client already has (AddSequence.output), so the new
    engine continues the same sequence and the client sees no duplicated and no missing token. Each
    move spends one retry from the server's RetryBudget. With no ready worker with room, or the budget
    spent, the stream ends with WorkerDied.
fair room: inside a priority class a worker's waiting room is shared by tenant weight, as a batch
    model's queue is (routing/fairness.py `displacement`): while no ready worker has free room, a
    sequence whose tenant stays within its share of a worker's room takes it by displacing the newest
    waiting sequences of tenants over theirs (their streams fail with Overloaded, their sequences are
    aborted in the engine before the new one arrives). So a flooding tenant gets the 429s, not the
    others. The engine then admits its waiting tenants in weighted fair order (inferd.kinds.llm.waiting).
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from inferd.clock import Clock
from inferd.errors import Overloaded, ServingError, WorkerDied, WorkerUnavailable
from inferd.kinds.llm.kv import BlockHash
from inferd.kinds.llm.plan import SchedulerConfig
from inferd.kinds.llm.routing import PrefixAffinityRouter, WorkerLoad
from inferd.kinds.llm.stream import TokenStream
from inferd.observability import tracing
from inferd.routing.fairness import INTERACTIVE, TenantShare, displacement, gave_way
from inferd.routing.health import Health
from inferd.routing.locality import NO_ZONE, LocalityPolicy, LocalityStatistics
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState

log = logging.getLogger("inferd.llm")


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
    """The prefix-cache salt and the tenant's lane: one value, the call's tenant (core/tenant.py: the
    authenticated tenant, else the anonymous one the caller named)."""
    weight: float = 1.0
    """The tenant's weight: its share of waiting room and admissions inside the priority class."""
    ignore_eos: bool = False
    deadline: float | None = None
    """Absolute time (the runtime's clock) past which the sequence is aborted and its stream fails
    with DeadlineExceeded; None: no deadline."""

    @property
    def share(self) -> TenantShare:
        return TenantShare(self.tenant, self.weight)


@dataclass(slots=True, eq=False)
class Live:
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
class Waiting:
    """One priority class's sequences on a worker not yet admitted there, per tenant."""

    seqs: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, share: TenantShare, tokens: int) -> None:
        self.seqs[share.name] = self.seqs.get(share.name, 0) + 1
        self.tokens[share.name] = self.tokens.get(share.name, 0) + tokens
        self.weights[share.name] = share.weight

    def remove(self, tenant: str, tokens: int) -> None:
        self.seqs[tenant] -= 1
        self.tokens[tenant] -= tokens
        if not self.seqs[tenant]:
            del self.seqs[tenant], self.tokens[tenant], self.weights[tenant]

    def total(self) -> tuple[int, int]:
        return sum(self.seqs.values()), sum(self.tokens.values())


@dataclass(slots=True)
class Load:
    """What the front end has placed on one worker."""

    live: int = 0
    waiting: int = 0
    waiting_prompt_tokens: int = 0
    busy_since: float = 0.0
    """When `live` last went from 0 to 1 (the hang watchdog counts from there)."""
    classes: tuple[Waiting, Waiting] = field(default_factory=lambda: (Waiting(), Waiting()))
    """The waiting ones per priority class and tenant (fair room)."""


class Placement:
    def __init__(
        self,
        name: str,
        workers: list[WorkerConnection],
        scheduler: SchedulerConfig,
        router: PrefixAffinityRouter,
        retry_budget: RetryBudget,
        clock: Clock,
        locality: LocalityPolicy | None = None,
    ) -> None:
        self.name = name
        self.workers = workers
        """The runtime's list of connected workers (shared, not copied)."""
        self.scheduler = scheduler
        self.router = router
        self.retry_budget = retry_budget
        self.clock = clock
        self.locality = locality
        """Zone routing (routing/locality.py); None, or a front end or workers without zones: one pool."""
        self.live: dict[str, Live] = {}
        self.loads: dict[str, Load] = {}
        self._views: dict[str, WorkerLoad] = {}
        """Each ready worker as the router last saw it, dropped whenever its Load changes."""
        self.step_s = scheduler.initial_step_s
        """EWMA of the workers' step times, for Retry-After hints."""
        self.stopping = False
        self.rejected = 0
        """Sequences refused with Overloaded: at submission, or displaced from a worker's waiting room."""
        self.moved = 0
        self.lost = 0
        self._deadlines: list[tuple[float, str]] = []
        """(deadline, seq_id) of live sequences that have one: a heap, earliest first."""

    # ---- placing ----------------------------------------------------------------------------------
    def start(self, live: Live, worker: WorkerConnection) -> None:
        """Place a new sequence on the worker `choose` gave."""
        self.live[live.stream.seq_id] = live
        if live.gen.deadline is not None:
            if len(self._deadlines) > 2 * len(self.live) + 64:  # mostly sequences that ended in time
                self._deadlines = [(d, s) for d, s in self._deadlines if s in self.live]
                heapq.heapify(self._deadlines)
            heapq.heappush(self._deadlines, (live.gen.deadline, live.stream.seq_id))
        self.retry_budget.record_requests(1)
        self.place(live, worker)

    def choose(self, prompt_tokens: int, hashes: list[BlockHash], gen: Generation) -> WorkerConnection:
        """The worker for a sequence. Raises WorkerUnavailable (none ready) or Overloaded (no ready
        worker's queue has room, not even within the tenant's share) before anything is sent."""
        if self.stopping:
            raise WorkerUnavailable(f"model '{self.name}' is shutting down")
        ready = [w for w in self.workers if w.state is WorkerState.READY and not w.failure]
        if not ready:
            raise WorkerUnavailable(f"model '{self.name}' has no ready worker; retry shortly")
        views = self._views
        loads = [views.get(w.worker_id) or self._view(w.worker_id) for w in ready]
        locality = self.locality
        if locality is None or not locality.active:
            choice = self.router.pick(loads, hashes, prompt_tokens)
        else:
            choice = self.router.pick_first(self._by_zone(locality, ready, loads), hashes, prompt_tokens)
        if choice is not None:
            worker = next(w for w in ready if w.worker_id == choice.worker_id)
            if locality is not None and locality.active:
                locality.served(worker.zone or NO_ZONE)
            return worker
        worker = self._make_room(ready, prompt_tokens, gen)
        if worker is None:
            s = self.scheduler
            raise Overloaded(
                f"model '{self.name}' is full: no ready worker (of {len(ready)}) can queue a sequence of "
                f"{prompt_tokens} prompt tokens (max_waiting_seqs={s.max_waiting_seqs}, "
                f"max_waiting_prompt_tokens={s.max_waiting_prompt_tokens} per worker)",
                self.retry_after_s(),
                reason="llm_queue_full",
            )
        return worker

    def zones(self) -> LocalityStatistics | None:
        """The zones' statistics, their shares computed now from the ready workers (true at scrape time)."""
        if self.locality is None:
            return None
        healthy = Counter(w.zone or NO_ZONE for w in self.workers if w.state is WorkerState.READY and not w.failure)
        return self.locality.statistics(healthy)

    @staticmethod
    def _by_zone(
        locality: LocalityPolicy, ready: list[WorkerConnection], loads: list[WorkerLoad]
    ) -> list[list[WorkerLoad]]:
        """The ready workers by zone, in the order zone routing tries them (`LocalityPolicy.order`)."""
        zones: dict[str, list[WorkerLoad]] = {}
        for w, load in zip(ready, loads, strict=True):
            zones.setdefault(w.zone or NO_ZONE, []).append(load)
        shares = locality.shares({zone: len(loads) for zone, loads in zones.items()})
        if not shares.shares:
            return [loads]
        return [zones[zone] for zone in locality.order(shares, zones)]

    def _make_room(
        self, ready: list[WorkerConnection], prompt_tokens: int, gen: Generation
    ) -> WorkerConnection | None:
        """The ready worker where `gen`'s tenant fits within its share by displacing the fewest waiting
        sequences of tenants over theirs, after displacing them; None: it fits on none."""
        best: tuple[WorkerConnection, list[Live]] | None = None
        for w in ready:
            victims = self._victims(w.worker_id, prompt_tokens, gen)
            if victims is not None and (best is None or len(victims) < len(best[1])):
                best = (w, victims)
        if best is None:
            return None
        worker, victims = best
        for live in victims:
            self.end(live)
            self.rejected += 1
            live.stream.fail(gave_way(self.name, live.gen.share, gen.share, self.retry_after_s()))
            worker.send(p.AbortSequence(live.stream.seq_id))
        return worker

    def _victims(self, worker_id: str, prompt_tokens: int, gen: Generation) -> list[Live] | None:
        """The newest waiting sequences on the worker to displace so `gen`'s fits within its tenant's
        share of the class's room, in sequences and in prompt tokens; None: it would exceed its share."""
        load = self.loads.get(worker_id) or Load()
        s = self.scheduler
        mine = load.classes[gen.priority]
        seqs, tokens = mine.total()
        others = (load.waiting - seqs, load.waiting_prompt_tokens - tokens)  # the other class's room
        free = (s.max_waiting_seqs - load.waiting, s.max_waiting_prompt_tokens - load.waiting_prompt_tokens)
        room = (s.max_waiting_seqs - others[0], s.max_waiting_prompt_tokens - others[1])
        by_seqs = displacement(gen.share, 1, free[0], room[0], mine.seqs, mine.weights)
        by_tokens = displacement(gen.share, prompt_tokens, free[1], room[1], mine.tokens, mine.weights)
        if by_seqs is None or by_tokens is None:
            return None
        victims = []
        for tenant in sorted(by_seqs.keys() | by_tokens.keys()):
            need_seqs, need_tokens = by_seqs.get(tenant, 0), by_tokens.get(tenant, 0)
            for live in self._newest_waiting(worker_id, tenant, gen.priority):
                if need_seqs <= 0 and need_tokens <= 0:
                    break
                victims.append(live)
                need_seqs -= 1
                need_tokens -= len(live.prompt)
        return victims

    def _newest_waiting(self, worker_id: str, tenant: str, priority: int) -> Iterator[Live]:
        for live in reversed(self.live.values()):
            g = live.gen
            if (
                live.waiting
                and live.stream.worker_id == worker_id
                and g.tenant == tenant
                and g.priority == priority
            ):
                yield live

    def _view(self, worker_id: str) -> WorkerLoad:
        """A ready worker as the router sees it, kept until its Load changes (most of them stay the
        same from one request to the next; with 100 workers, building every one per request cost more
        than the routing itself)."""
        load = self.loads.get(worker_id)
        if load is None:  # nothing placed there yet
            view = WorkerLoad(worker_id, Health.READY, 0, 0, 0)
        else:
            view = WorkerLoad(worker_id, Health.READY, load.live, load.waiting, load.waiting_prompt_tokens)
        self._views[worker_id] = view
        return view

    def place(self, live: Live, worker: WorkerConnection) -> None:
        """Send the sequence to `worker`, resuming after the tokens its stream already holds."""
        live.stream.worker_id = worker.worker_id
        live.waiting = True
        load = self.loads.setdefault(worker.worker_id, Load())
        self._views.pop(worker.worker_id, None)
        if load.live == 0:
            load.busy_since = self.clock.now()
        load.live += 1
        load.waiting += 1
        load.waiting_prompt_tokens += len(live.prompt)
        g = live.gen
        load.classes[g.priority].add(g.share, len(live.prompt))
        self.router.record(worker.worker_id, live.hashes)
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
                weight=g.weight,
                traceparent=tracing.traceparent(live.stream.trace),
            )
        )

    def retry_after_s(self) -> float:
        """The engines' hint: the steps to prefill the least-queued worker's waiting prompts."""
        s = self.scheduler
        queued = min((load.waiting_prompt_tokens for load in self.loads.values()), default=0)
        return max(s.min_retry_after_s, (queued / s.max_num_batched_tokens + 1) * self.step_s)

    # ---- counting off -----------------------------------------------------------------------------
    def admitted(self, live: Live) -> None:
        if not live.waiting:
            return
        live.waiting = False
        load = self.loads.get(live.stream.worker_id)
        if load is not None:
            self._views.pop(live.stream.worker_id, None)
            load.waiting -= 1
            load.waiting_prompt_tokens -= len(live.prompt)
            load.classes[live.gen.priority].remove(live.gen.tenant, len(live.prompt))

    def end(self, live: Live) -> None:
        self.admitted(live)
        del self.live[live.stream.seq_id]
        load = self.loads.get(live.stream.worker_id)
        if load is not None:
            self._views.pop(live.stream.worker_id, None)
            load.live -= 1

    def live_on(self, worker_id: str) -> int:
        """Sequences placed on the worker whose end the front end has not yet seen."""
        load = self.loads.get(worker_id)
        return 0 if load is None else load.live

    def expired(self) -> list[Live]:
        """Live sequences whose deadline has passed (each returned once)."""
        now = self.clock.now()
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq_id = heapq.heappop(self._deadlines)
            live = self.live.get(seq_id)
            if live is not None:
                out.append(live)
        return out

    # ---- failover ---------------------------------------------------------------------------------
    def forget(self, worker: WorkerConnection) -> list[Live]:
        """The worker is gone: its counts and its cache with it. Returns its orphaned sequences."""
        self.loads.pop(worker.worker_id, None)
        self._views.pop(worker.worker_id, None)
        self.router.forget(worker.worker_id)
        return [live for live in self.live.values() if live.stream.worker_id == worker.worker_id]

    def move(self, live: Live, why: str) -> None:
        """Place an orphaned sequence on another worker (resuming it), or end its stream with WorkerDied."""
        live.waiting = False  # its dead worker's counts are gone with it
        try:
            target = self.choose(len(live.prompt), live.hashes, live.gen)
        except ServingError as exc:
            self._give_up(live, f"{why}; it could not be moved: {exc.message}")
            return
        if not self.retry_budget.try_spend(1):
            self._give_up(live, f"{why}; the retry budget is spent, so it was not moved")
            return
        live.moves += 1
        self.moved += 1
        tracing.event(live.stream.trace, "resumed", {"worker_id": target.worker_id, "moves": live.moves})
        log.debug(
            "sequence %s moved to %s after %d tokens",
            live.stream.seq_id,
            target.worker_id,
            len(live.stream.generated),
        )
        self.place(live, target)

    def _give_up(self, live: Live, message: str) -> None:
        del self.live[live.stream.seq_id]
        self.lost += 1
        live.stream.fail(WorkerDied(message))
