"""Where a pooled model is loaded: a plain policy object (no I/O; the clock is injected), driven by the
front end's PoolManager (pools/manager.py) with what it knows: each pool worker's last PoolState and each
pooled model's demand on this front end. Its decisions are values (`Load`); the manager sends them.

The rules:

* **First load.** A model with requests waiting and no holder (no pool worker lists it loading or ready,
  none lists a load of it queued, and no load of it asked by this front end is pending) is loaded on the
  worker with the most free budget (budget - used - its queued loads, less the loads this front end
  asked of it that its PoolState does not show yet; none at max_loaded_models) among those whose whole
  budget can hold it. When none has the room free, the worker that can make room by evicting (its
  evictable models, as its PoolState says) and holds the longest idle of them: across the pool, the
  least recently used model goes (the worker decides its evictions itself, pools/residency.py: it
  evicts its least recently used first). When none
  can make room yet (every model protected by min_resident_s or busy), the one with the most free
  budget: the load waits there for room; but while the pool's own workers are still joining (at start,
  or one restarting: for at most the manager's JOIN_GRACE_S), it waits here for them instead (placed
  again on the next pass), so that a burst at start does not pile onto the first worker to join while
  an empty one is on its way.
* **Spreading a hot model.** A model whose queue holds more than `SPREAD_BATCHES` (2) full batches per
  worker serving it here, for longer than one batching wait plus one batch time (`batch_cycle_s`), gets
  one more holder: the worker that does not hold it with the most free budget (not while none of its
  holders serves here yet: their model servers are still joining). Never while a load of it is in
  progress anywhere (loading or queued in a PoolState, or pending here), so never more than one load at
  a time per model, and never more holders than pool workers. With several front ends only one spreads
  (`plan(spreads=True)`: the one that holds the `decider` lease, fleet/pools.py), counting in its queue
  the items the others report queued for the model (`ModelDemand.elsewhere`; heat resting on those
  reports must outlast one, `reports_s`): two front ends deciding at the same moment would each ask a
  worker of their own, two more holders instead of one.
* **Failures.** A failed load starts a backoff (routing/backoff.py's `Backoff`) before the model is
  loaded again, doubling with each failure in a row, reset by a load that succeeds: a load that keeps
  failing never loops. `retry_in` says how long is left (the 503's Retry-After). A load whose worker
  left before answering, holding no model ready (nothing else could have ended it), is a failure in a
  row too: the first is asked again at once, the next backs off.
* **Joining loads.** Several front ends asking for the same model meet at the worker, which joins a
  LoadModel for a model it loads, holds or has queued; a front end that sees the model loading or queued
  in any PoolState asks no other worker (its requests wait for that load, and fail with it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from inferd.clock import Clock
from inferd.routing.backoff import Backoff

SPREAD_BATCHES = 2
"""Full batches queued per serving worker past which a model is hot (one more holder)."""
LOAD_BACKOFF = Backoff(1.0, 60.0)
"""After a failed load: 1 s, doubling with each failure in a row, up to 60 s."""
REPORTS_S = 1.0
"""How often the other front ends report their queues (cluster/load.py, runtime/frontend_load.py)."""

Key = tuple[str, int]
HOLDING = frozenset({"loading", "ready"})
"""A worker's states of a model that count as holding it ("unloading" does not: it is leaving)."""
QUEUED = "queued"
"""A worker's state of a model whose load waits there to start (PoolState.queued)."""
COMING = frozenset({QUEUED, "loading"})
"""A load of the model in progress there: queued or loading."""


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One pool worker, as its last PoolState says."""

    worker_id: str
    budget_mb: float
    used_mb: float
    held: Mapping[Key, str]
    """(model, version) -> "queued", "loading", "ready" or "unloading" (queued beats unloading: the load
    waits for the copy that leaves)."""
    accepts: bool = True
    """False while it drains: no load is sent to it."""
    evictable: tuple[tuple[float, float], ...] = ()
    """(memory_mb, idle_s) of each model it may evict now (idle, past min_resident_s)."""
    slots: int | None = None
    """How many more models it may hold under max_loaded_models (None: no cap; its queued loads count)."""
    queued_mb: float = 0.0
    """What its queued loads will take: they start before any load asked of it now."""

    @property
    def free_mb(self) -> float:
        return self.budget_mb - self.used_mb - self.queued_mb

    def holds(self, key: Key) -> bool:
        return self.held.get(key) in HOLDING

    def loads(self, key: Key) -> bool:
        """A load of the model is in progress here (queued or loading)."""
        return self.held.get(key) in COMING

    def shows(self, key: Key) -> bool:
        """Its PoolState lists the model taking room here (queued, loading or ready)."""
        return self.held.get(key) in COMING or self.held.get(key) == "ready"


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """One pooled model version on this front end."""

    model: str
    version: int
    waiting: int
    """Items waiting for it here (in its cold queue or its queue)."""
    serving: int
    """Its workers in service here (the model servers of the workers that hold it)."""
    memory_mb: float
    """What one copy takes: measured by a load, else its estimate (memory_mb)."""
    full_batch: int = 1
    """Its max_batch_size."""
    batch_cycle_s: float = 0.0
    """One batching wait plus one batch time (measured; the wait alone before a batch ran)."""
    elsewhere: int = 0
    """Items waiting for it on the other front ends (their latest load reports: the spreading front
    end's; 0 alone). Counted for heat only: their first loads are theirs to ask."""

    @property
    def key(self) -> Key:
        return (self.model, self.version)


@dataclass(frozen=True, slots=True)
class Load:
    """Send LoadModel for this model version to this worker."""

    model: str
    version: int
    worker_id: str
    spread: bool = False
    """One more holder of a hot model (False: its first)."""


@dataclass(slots=True)
class _Pending:
    worker_id: str
    since: float
    memory_mb: float


class Placement:
    def __init__(
        self, clock: Clock, backoff: Backoff = LOAD_BACKOFF, pending_timeout_s: float = 300.0,
        reports_s: float = REPORTS_S,
    ) -> None:
        self.clock = clock
        self.backoff = backoff
        self.reports_s = reports_s
        """How old the other front ends' queue reports (`ModelDemand.elsewhere`) may be: heat that rests
        on them must outlast one, so that a report written before the last holder served does not spread
        the model again."""
        self.pending_timeout_s = pending_timeout_s
        """A load asked for and never answered (no LoadResult, its worker still there) is forgotten after
        this long, so that a lost answer cannot keep a model unloaded for good."""
        self._pending: dict[Key, _Pending] = {}
        self._failures: dict[Key, int] = {}
        self._retry_at: dict[Key, float] = {}
        self._hot_since: dict[Key, float] = {}

    # ---- deciding ----------------------------------------------------------------------------------
    def plan(
        self, workers: Sequence[WorkerView], demands: Iterable[ModelDemand], patient: bool = False,
        spreads: bool = True,
    ) -> list[Load]:
        """The loads to send now (each recorded as pending until `ended`). `patient`: more of the pool's
        own workers are on their way (starting, restarting): a load that no worker has room for now, nor
        can make room for, waits here for them instead of waiting at a worker for room. `spreads`: this
        front end gives hot models more holders (False: another one does; it asks first loads only)."""
        now = self.clock.now()
        self._expire(now, {w.worker_id for w in workers})
        planned = self._asked(workers)  # worker -> MiB of the loads asked of it that its state does not show
        loads: list[Load] = []
        for demand in sorted(demands, key=lambda d: (-d.waiting, d.key)):
            load = self._decide(demand, workers, planned, now, patient, spreads)
            if load is not None:
                self._pending[demand.key] = _Pending(load.worker_id, now, demand.memory_mb)
                planned[load.worker_id] = planned.get(load.worker_id, 0.0) + demand.memory_mb
                loads.append(load)
        return loads

    def _decide(
        self, demand: ModelDemand, workers: Sequence[WorkerView], planned: Mapping[str, float], now: float,
        patient: bool, spreads: bool,
    ) -> Load | None:
        key = demand.key
        if self.retry_in(*key) is not None:
            return None
        if key in self._pending or any(w.loads(key) for w in workers):  # join it: no other copy
            self._hot_since.pop(key, None)  # a load is in progress: the next one is judged after it
            return self._join_queued(demand, workers)
        holders = [w for w in workers if w.holds(key)]
        if not holders:
            if demand.waiting <= 0:
                return None
            target = self._roomiest(workers, demand, planned, patient)
            return None if target is None else Load(demand.model, demand.version, target)
        if not spreads:
            self._hot_since.pop(key, None)
            return None
        if not self._hot(demand, now):
            return None
        target = self._roomiest([w for w in workers if not w.holds(key)], demand, planned, patient)
        if target is None:
            return None
        self._hot_since.pop(key, None)
        return Load(demand.model, demand.version, target, spread=True)

    def _join_queued(self, demand: ModelDemand, workers: Sequence[WorkerView]) -> Load | None:
        """A load another front end asked, still queued on a worker (waiting for room, or behind its
        max_concurrent_loads), with requests waiting here and no copy held: the same LoadModel to that
        worker joins it, so that its wait for room runs to this front end's deadline too, not only to the
        first asker's (the worker keeps the latest: pools/residency.py `ask`). A load under way has no
        such wait: nothing to ask."""
        key = demand.key
        if key in self._pending or demand.waiting <= 0 or any(w.holds(key) for w in workers):
            return None
        queued = [w for w in workers if w.held.get(key) == QUEUED and w.accepts]
        return Load(demand.model, demand.version, queued[0].worker_id) if queued else None

    def _hot(self, demand: ModelDemand, now: float) -> bool:
        """More than SPREAD_BATCHES full batches queued per serving worker (here and, as reported, on the
        other front ends), for longer than a cycle (than a report too, when this front end's queue alone
        is not past it). With none serving here yet (its holders' model servers still joining), nothing
        says what they serve."""
        most = SPREAD_BATCHES * demand.full_batch * demand.serving
        if demand.serving == 0 or demand.waiting + demand.elsewhere <= most:
            self._hot_since.pop(demand.key, None)
            return False
        since = self._hot_since.setdefault(demand.key, now)
        lasting = demand.batch_cycle_s if demand.waiting > most else max(demand.batch_cycle_s, self.reports_s)
        return now - since > lasting

    @staticmethod
    def _roomiest(
        workers: Iterable[WorkerView], demand: ModelDemand, planned: Mapping[str, float], patient: bool = False
    ) -> str | None:
        """Where to load (the rule in the module's docstring), among the workers whose whole budget can
        hold the model; free budget counts the loads asked of a worker that its PoolState does not show
        yet (`planned`: this pass's and the earlier ones'); ties go to the lowest id (the same choice on
        every front end). None when none fits, or (`patient`) when none has or can make room now."""

        def rank(w: WorkerView) -> tuple[int, float, float]:
            free = w.free_mb - planned.get(w.worker_id, 0.0)
            if free >= demand.memory_mb and (w.slots is None or w.slots > 0):
                return (2, free, 0.0)
            if w.evictable and free + sum(mb for mb, _ in w.evictable) >= demand.memory_mb:
                return (1, max(idle for _, idle in w.evictable), free)
            return (0, free, 0.0)

        fits = [w for w in workers if w.accepts and w.budget_mb >= demand.memory_mb]
        if not fits:
            return None
        ranked = sorted(fits, key=lambda w: w.worker_id)
        best = max(ranked, key=rank)
        return None if patient and rank(best)[0] == 0 else best.worker_id

    def _asked(self, workers: Sequence[WorkerView]) -> dict[str, float]:
        """MiB of the loads asked of each worker (pending) that its last PoolState does not list yet (not
        received yet; or queued, from a worker whose PoolState does not list its queue): they take its
        room all the same, so that the first requests of a burst, each placed in a pass of its own, do
        not all pick the same worker. One it lists is counted there (used_mb, queued_mb)."""
        views = {w.worker_id: w for w in workers}
        asked: dict[str, float] = {}
        for key, pending in self._pending.items():
            view = views.get(pending.worker_id)
            if view is not None and not view.shows(key):
                asked[pending.worker_id] = asked.get(pending.worker_id, 0.0) + pending.memory_mb
        return asked

    def _expire(self, now: float, present: set[str]) -> None:
        for key, pending in list(self._pending.items()):
            if pending.worker_id not in present or now - pending.since > self.pending_timeout_s:
                del self._pending[key]

    # ---- what happened -------------------------------------------------------------------------------
    def ended(self, model: str, version: int, worker_id: str, ok: bool) -> None:
        """A load ended on `worker_id` (its LoadResult): the pending load is answered; a failure starts
        (or lengthens) the model's backoff, a success resets it."""
        key = (model, version)
        pending = self._pending.get(key)
        if pending is not None and pending.worker_id == worker_id:
            del self._pending[key]
        if ok:
            self._failures.pop(key, None)
            self._retry_at.pop(key, None)
            return
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        self._retry_at[key] = self.clock.now() + self.backoff.delay_s(failures)

    def worker_gone(self, worker_id: str, only_loading: bool = False) -> list[Key]:
        """Its pool link closed: the loads asked of it will not be answered. With `only_loading` (the worker
        held no model ready: nothing but its loads could have ended it), each is a failure in a row of its
        model: a first one is asked again at once (of another worker, or of this one once it is back), a
        second one in a row starts the backoff as a failed load does, so that a load that kills its worker
        (the OOM killer, a crash in the model's code) is not asked again and again. Without (a batch of
        another model may have ended it), they are only forgotten. Returns the models whose backoff
        started (their waiting requests fail, as for a failed load)."""
        now = self.clock.now()
        backed_off: list[Key] = []
        for key, pending in list(self._pending.items()):
            if pending.worker_id != worker_id:
                continue
            del self._pending[key]
            if not only_loading:
                continue
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
            if failures > 0:
                self._retry_at[key] = now + self.backoff.delay_s(failures)
                backed_off.append(key)
        return backed_off

    def forget(self, model: str, version: int) -> None:
        """The model version is no longer served (unloaded): its pending load, backoff and heat go."""
        key = (model, version)
        for table in (self._pending, self._failures, self._retry_at, self._hot_since):
            table.pop(key, None)

    # ---- what it says ------------------------------------------------------------------------------------
    def retry_in(self, model: str, version: int) -> float | None:
        """Seconds left before a model whose load failed may be loaded again; None: it may now."""
        at = self._retry_at.get((model, version))
        if at is None:
            return None
        left = at - self.clock.now()
        return left if left > 0 else None

    def pending(self, model: str, version: int) -> str | None:
        """The worker a load of it was asked of and has not answered yet; None: none."""
        pending = self._pending.get((model, version))
        return None if pending is None else pending.worker_id

