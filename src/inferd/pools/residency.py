"""What one pool worker holds, and what it evicts to load another: a plain policy object, no I/O.

The pool worker (worker/pool.py) tells it what happens (`ask`, `loaded`, `load_failed`, `unloaded`,
`busy`/`idle`, `unload`) and carries out what `step` decides (`StartLoad`, `Evict`, `FailLoad`), calling
`step` again after every event and at `next_at`. Sizes are MiB: a model's measured size once one load of
it was measured here, else the estimate the load was asked with.

A load starts when it fits: the memory held (models loading, ready or unloading) plus its size is within
the budget, fewer than `max_loaded_models` are held, and fewer than `max_concurrent_loads` load now. When
it does not fit, the least recently used idle models (ready, no batch held) are evicted until, once they
are unloaded, it fits; it then starts. A model loaded less than `min_resident_s` ago is protected: when
one is among those least recently used models, nothing is evicted and the load waits for it to age,
rather than evicting a model used since (LRU order is kept: a hot model does not go because the models
loaded after it are protected). The load waits so until it fits, or until its `wait_s` runs out: it
then fails, naming the sizes. A model bigger
than the whole budget fails at once. Loads start in the order asked (the first waits, those behind it
too: none starves). A measurement above the estimate can take the memory held past the budget: the
evictable models are then evicted, least recently used first, until it is back within. At most
`max_waiting_loads` loads wait: a load asked past them fails at once, naming the bound (each model a
front end names costs a waiting load, so what a peer can make the worker hold is bounded).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inferd.clock import Clock

Key = tuple[str, int]
"""(model, version)."""

LOADING = "loading"
READY = "ready"
UNLOADING = "unloading"


@dataclass(frozen=True)
class Limits:
    """A pool's settings that bind one worker (`[pools.NAME]`)."""

    budget_mb: float
    max_loaded_models: int | None = None
    max_concurrent_loads: int = 1
    min_resident_s: float = 5.0
    max_waiting_loads: int = 64
    """Loads waiting to start, at most (past it a load fails at once): a front end cannot make the worker
    queue one load per model name it sends."""


@dataclass
class Resident:
    """A model the worker holds (loading, ready or unloading)."""

    key: Key
    state: str
    size_mb: float
    since: float
    """When its load started (loading), or ended (ready, unloading)."""
    last_used: float
    """When its last batch ended (or its load, when it ran none)."""
    busy: int = 0
    """Batches it holds now (waiting for the device, or running)."""
    unload_when_loaded: bool = False
    """Asked to unload while it loaded: it is unloaded as soon as it is."""


@dataclass
class PendingLoad:
    key: Key
    size_mb: float
    deadline: float
    """When it fails if no room was found (asked + wait_s, the latest of those who asked)."""
    wait_s: float


@dataclass(frozen=True)
class StartLoad:
    key: Key
    size_mb: float


@dataclass(frozen=True)
class Evict:
    key: Key


@dataclass(frozen=True)
class FailLoad:
    key: Key
    reason: str


@dataclass(frozen=True)
class Joined:
    """The load asked for joins one held (`ready`: loaded already) or asked before."""

    key: Key
    ready: bool


@dataclass(frozen=True)
class Queued:
    key: Key


Action = StartLoad | Evict | FailLoad


def _name(key: Key) -> str:
    return f"{key[0]} v{key[1]}"


class Residency:
    def __init__(self, limits: Limits, clock: Clock) -> None:
        self.limits = limits
        self.clock = clock
        self.held: dict[Key, Resident] = {}
        self.pending: deque[PendingLoad] = deque()
        self.measured: dict[Key, float] = {}
        """Each model's size as its last load here measured it."""

    # ---- what happens ---------------------------------------------------------------------------------
    def ask(self, key: Key, estimate_mb: float, wait_s: float) -> Joined | Queued | FailLoad:
        """A front end asks for a load. Joins one held or pending; else queues it, or fails it at once when
        the model is bigger than the whole budget."""
        now = self.clock.now()
        resident = self.held.get(key)
        if resident is not None and resident.state != UNLOADING:
            resident.unload_when_loaded = False
            return Joined(key, resident.state == READY)
        for load in self.pending:
            if load.key == key:
                load.deadline = max(load.deadline, now + wait_s)
                return Joined(key, False)
        if len(self.pending) >= self.limits.max_waiting_loads:
            return FailLoad(
                key,
                f"model {_name(key)} not queued: the pool worker has {len(self.pending)} loads waiting "
                f"already, at most {self.limits.max_waiting_loads}",
            )
        size = self.size_mb(key, estimate_mb)
        if size > self.limits.budget_mb:
            return FailLoad(
                key,
                f"model {_name(key)} needs {size:g} MB, more than the pool worker's whole memory budget "
                f"of {self.limits.budget_mb:g} MB",
            )
        self.pending.append(PendingLoad(key, size, now + wait_s, wait_s))
        return Queued(key)

    def loaded(self, key: Key, measured_mb: float) -> bool:
        """Its load ended well, costing `measured_mb`. False: it was asked to unload meanwhile (it is
        unloading now: drain it and unload it)."""
        resident = self.held[key]
        now = self.clock.now()
        # The largest measured: a process's resident memory may not grow on a reload into memory freed
        # by the last unload and kept by the allocator, and a load beside another may measure both.
        resident.size_mb = self.measured[key] = max(measured_mb, self.measured.get(key, 0.0))
        resident.since = resident.last_used = now
        resident.state = UNLOADING if resident.unload_when_loaded else READY
        return resident.state == READY

    def load_failed(self, key: Key) -> None:
        self.held.pop(key, None)

    def unloaded(self, key: Key) -> None:
        """Its memory is free (drained, unloaded, collected)."""
        self.held.pop(key, None)

    def unload(self, key: Key) -> bool | FailLoad | None:
        """A front end asks to unload it. True: it was ready and is unloading now (drain it, unload it);
        FailLoad: its load had not started (it never will); None: nothing to do now (not held, unloading
        already, or loading: unloaded once loaded)."""
        for load in self.pending:
            if load.key == key:
                self.pending.remove(load)
                return FailLoad(key, f"model {_name(key)} was unloaded before its load started")
        resident = self.held.get(key)
        if resident is None or resident.state == UNLOADING:
            return None
        if resident.state == LOADING:
            resident.unload_when_loaded = True
            return None
        resident.state = UNLOADING
        return True

    def busy(self, key: Key) -> None:
        """A batch of its waits for the device, or runs."""
        if key in self.held:
            self.held[key].busy += 1

    def idle(self, key: Key) -> None:
        """A batch of its ended."""
        resident = self.held.get(key)
        if resident is not None:
            resident.busy -= 1
            resident.last_used = self.clock.now()

    # ---- what to do -----------------------------------------------------------------------------------
    def step(self) -> list[Action]:
        """What to do now: evictions (each model is marked unloading as it is decided), loads to start
        (marked loading) and loads that fail. Carry them all out, then call again after the next event."""
        now = self.clock.now()
        actions: list[Action] = self._back_within_budget(now)
        while self.pending:
            load = self.pending[0]
            if load.key in self.held:  # its previous copy is still unloading
                break
            if self._count(LOADING) >= self.limits.max_concurrent_loads:
                break
            if self._fits_now(load.size_mb):
                self.pending.popleft()
                self.held[load.key] = Resident(load.key, LOADING, load.size_mb, now, now)
                actions.append(StartLoad(load.key, load.size_mb))
                continue
            short_mb, short_models = self._short(load.size_mb)
            if short_mb <= 0 and short_models <= 0:  # the unloads under way make room
                break
            victims = self._victims(now, short_mb, short_models)
            if victims is not None:
                for victim in victims:
                    victim.state = UNLOADING
                    actions.append(Evict(victim.key))
                break
            if now < load.deadline:  # protected models will age, or batches end: wait for them
                break
            self.pending.popleft()
            actions.append(FailLoad(load.key, self._no_room(load)))
        return actions

    def next_at(self) -> float | None:
        """When `step` may decide something new without an event: a waiting load's deadline, or a
        protected model becoming evictable. None: only an event can change anything."""
        if not self.pending:
            return None
        now = self.clock.now()
        times = [load.deadline for load in self.pending]
        times += [self.protected_until(r) for r in self.held.values() if r.state == READY]
        times = [t for t in times if t > now]
        return min(times, default=None)  # never a time gone by: a driver would wake at once, again and again

    # ---- what it holds --------------------------------------------------------------------------------
    def size_mb(self, key: Key, estimate_mb: float) -> float:
        """The size a load of it is planned at: measured here before, else the estimate."""
        return self.measured.get(key, estimate_mb)

    def knows(self, key: Key) -> bool:
        """Whether the model is held (loading, ready, unloading) or its load waits to start."""
        return key in self.held or any(load.key == key for load in self.pending)

    def used_mb(self) -> float:
        return sum(r.size_mb for r in self.held.values())

    def evictable(self, resident: Resident, now: float) -> bool:
        return resident.state == READY and resident.busy == 0 and now >= self.protected_until(resident)

    def protected_until(self, resident: Resident) -> float:
        """When min_resident_s ends for it: `evictable` and `next_at` compare the same sum with `now`
        (`now - since >= min_resident_s` can be false where `since + min_resident_s <= now` is true, in
        floating point: the wake-up for it would then be skipped)."""
        return resident.since + self.limits.min_resident_s

    def _count(self, state: str) -> int:
        return sum(1 for r in self.held.values() if r.state == state)

    def _fits_now(self, size_mb: float) -> bool:
        cap = self.limits.max_loaded_models
        return self.used_mb() + size_mb <= self.limits.budget_mb and (cap is None or len(self.held) < cap)

    def _short(self, size_mb: float) -> tuple[float, int]:
        """(MiB, models) missing for a load of `size_mb` once the unloads under way are done."""
        staying = [r for r in self.held.values() if r.state != UNLOADING]
        short_mb = sum(r.size_mb for r in staying) + size_mb - self.limits.budget_mb
        cap = self.limits.max_loaded_models
        return short_mb, 0 if cap is None else len(staying) + 1 - cap

    def _victims(self, now: float, short_mb: float, short_models: int) -> list[Resident] | None:
        """The least recently used evictable models that make up what is short; None when all of them
        would not."""
        chosen: list[Resident] = []
        freed = 0.0
        idle = sorted((r for r in self.held.values() if r.state == READY and r.busy == 0), key=lambda r: r.last_used)
        for resident in idle:
            if freed >= short_mb and len(chosen) >= short_models:
                break
            if not self.evictable(resident, now):  # protected: wait for it rather than evict a model used
                return None  # since (a hot model would go while a one-off load, just made, stays)
            chosen.append(resident)
            freed += resident.size_mb
        return chosen if freed >= short_mb and len(chosen) >= short_models else None

    def _back_within_budget(self, now: float) -> list[Action]:
        """A load measured above its estimate took the memory held past the budget: evict the least
        recently used evictable models until it is back within (or none is left to evict)."""
        over = sum(r.size_mb for r in self.held.values() if r.state != UNLOADING) - self.limits.budget_mb
        actions: list[Action] = []
        if over <= 0:
            return actions
        for resident in sorted(self.held.values(), key=lambda r: r.last_used):
            if over <= 0:
                break
            if self.evictable(resident, now):
                resident.state = UNLOADING
                over -= resident.size_mb
                actions.append(Evict(resident.key))
        return actions

    def _no_room(self, load: PendingLoad) -> str:
        held = [r for r in self.held.values() if r.state != UNLOADING]
        cap = self.limits.max_loaded_models
        return (
            f"no room for model {_name(load.key)} ({load.size_mb:g} MB) within {load.wait_s:g} s: "
            f"{self.used_mb():g} of {self.limits.budget_mb:g} MB held by {len(held)} models"
            + (f" (at most {cap})" if cap is not None else "")
            + f", none of them evictable (idle, and loaded for min_resident_s = {self.limits.min_resident_s:g} s)"
        )
