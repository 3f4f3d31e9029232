"""A worker's batch slots, shared by the front ends it serves. A plain object: an injected clock, no I/O.

The worker holds at most CAP batches (1 running on the device + 1 staged behind it) in total, whichever
front ends sent them. It keeps that cap by granting slots (protocol.Credit): a front end sends a batch
only against a slot it was granted, so

    held batches + slots granted and not yet used <= CAP        (at every moment)

* One front end: it is granted every free slot at once, unasked (no round trip: the front end sees the
  worker as it always has, two batches in flight).
* Several: a free slot goes to a front end that reported queued work (protocol.Demand) and holds no
  unused slot, the one whose oldest item has waited longest first (ties: the fuller queue). Each front
  end's batches then carry what arrived while the others' ran, so splitting arrivals over front ends
  does not shrink batches. A front end gives back slots it cannot use at once (its queue is empty).
* A front end that leaves gives its unused slots back; batches it sent still run (and still count)
  until they finish.
* Front ends of an older inferd (no credits) may send two batches at any time: such a front end is
  only served alone, whichever joined first (`accepts`).

`high_water` is the most batches ever held at once: what a test reads to check the cap.

A front end holding a slot while another's batch runs times its staging from that batch: the worker says
(Credit.running_items, running_for_s) what runs on it whenever a batch starts, to the front ends holding
slots (`to_tell`); else a front end would time it from its own (empty) share and stage too early.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from inferd.clock import Clock

CAP = 2
"""One batch running on the device and at most one staged behind it."""
STALE_HOLD_S = 1.0
"""A front end told "idle" that has held its slot this long without using it no longer keeps the others
"busy" (a first holder normally sends within its batch wait, milliseconds)."""


@dataclass(slots=True)
class FrontDemand:
    """What the worker knows of one front end."""

    legacy: bool = False
    """An older front end that takes no credits (it assumes CAP slots of its own)."""
    outstanding: int = 0
    """Slots granted and not yet used (or given back)."""
    queued: int = 0
    oldest_age_s: float = 0.0
    reported_at: float = 0.0
    holds_since: int = 0
    """When (the ledger's grant count) it was granted the slots it holds: the first holder runs next."""
    held_at: float = 0.0
    """When (the clock) it was granted them."""


class ToldState(NamedTuple):
    """What a front end holding a slot is told again when it changes."""

    idle: bool
    shared: bool
    starts: int
    """Batches started on the device so far (a new one: the front ends re-time their staging)."""
    empty: bool
    """Nothing is held (a front end told "busy" then waits for another's batch, not for one running)."""


@dataclass(frozen=True, slots=True)
class CreditStatistics:
    fronts: int
    held: int
    outstanding: int
    high_water: int
    granted: int
    returned: int


class CreditLedger:
    def __init__(self, clock: Clock, cap: int = CAP) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.clock = clock
        self.cap = cap
        self.held = 0
        """Batches received and not yet finished (running + staged)."""
        self.high_water = 0
        self._fronts: dict[Hashable, FrontDemand] = {}
        self._granted = self._returned = 0
        self._held_items: deque[int] = deque()
        """Items of each held batch, in the order received (the first runs)."""
        self.starts = 0
        self.running_items = 0
        """Items of the batch running on the device; 0 while none runs."""
        self._started_at = 0.0

    # ---- membership ------------------------------------------------------------------------------------
    def accepts_legacy(self) -> bool:
        """Whether a front end without credits may join now: only when it would be served alone."""
        return not self._fronts

    def accepts(self, credits: bool) -> bool:
        """Whether a front end (taking credits or not) may join now: one without credits is served only
        alone, whichever joined first."""
        return self.accepts_legacy() if not credits else not any(d.legacy for d in self._fronts.values())

    def join(self, front: Hashable, legacy: bool = False) -> None:
        if legacy and self._fronts:
            raise ValueError("a front end without credits can only be served alone")
        self._fronts[front] = FrontDemand(legacy=legacy)

    def leave(self, front: Hashable) -> None:
        """The front end is gone: its unused slots come back (its batches still held run on)."""
        self._fronts.pop(front, None)

    @property
    def shared(self) -> bool:
        return len(self._fronts) > 1

    @property
    def idle(self) -> bool:
        return self.held == 0

    def fronts(self) -> list[Hashable]:
        return list(self._fronts)

    def outstanding(self, front: Hashable) -> int:
        d = self._fronts.get(front)
        return 0 if d is None else d.outstanding

    # ---- events ----------------------------------------------------------------------------------------
    def report(self, front: Hashable, queued: int, oldest_age_s: float, returned: int = 0) -> None:
        """The front end's Demand: what it has queued, and slots it gives back unused."""
        d = self._fronts.get(front)
        if d is None:
            return
        back = max(0, min(returned, d.outstanding))
        d.outstanding -= back
        self._returned += back
        d.queued = max(0, queued)
        d.oldest_age_s = max(0.0, oldest_age_s)
        d.reported_at = self.clock.now()

    def received(self, front: Hashable, items: int = 0) -> None:
        """A batch of `items` arrived from the front end: it used one of its slots (a legacy front end has
        its own). Held batches run in the order received, one at a time: the first starts at once."""
        d = self._fronts.get(front)
        if d is not None and d.outstanding > 0:
            d.outstanding -= 1
        if d is not None and not d.legacy:
            d.queued = 0  # the batch took its queue; it reports again if items remain
        self.held += 1
        self.high_water = max(self.high_water, self.held)
        self._held_items.append(items)
        if self.held == 1:
            self._start()

    def finished(self) -> None:
        """The running batch finished (or was dropped unstarted): its slot is free, the next one held
        starts. (Said in the same Credit as the slot freed: told apart, a front end granted the slot
        would stage by a running batch it does not know yet, and wait a whole batch behind it.)"""
        self.held = max(0, self.held - 1)
        if self._held_items:
            self._held_items.popleft()
        if self.held:
            self._start()
        else:
            self.running_items = 0

    def _start(self) -> None:
        self.starts += 1
        self.running_items = self._held_items[0] if self._held_items else 0
        self._started_at = self.clock.now()

    def state_for(self, front: Hashable) -> ToldState:
        """The state as `front` is told it: idle only if nothing is held and no other front end holds a
        slot (two front ends told "idle" at once would each send a batch to run, and one would wait a
        whole batch behind the other; told "busy", the second stages only a full batch, on time). Of
        several holding slots, the one granted first is told "idle"; the others, when it has used or
        given back its slot, or has held it STALE_HOLD_S without (its front end ejected the worker, or
        stalled: the worker re-tells its front ends at each heartbeat)."""
        return self._state(front, self._first_holders())

    def _first_holders(self) -> list[tuple[int, Hashable]]:
        """The two front ends granted first among those holding slots, not stale: (holds_since, front).
        Two are enough to answer `_state` for every front end, so telling F front ends costs O(F)."""
        now = self.clock.now()
        fresh = [
            (d.holds_since, f) for f, d in self._fronts.items() if d.outstanding and now - d.held_at < STALE_HOLD_S
        ]
        return heapq.nsmallest(2, fresh, key=_first)

    def _state(self, front: Hashable, first: list[tuple[int, Hashable]]) -> ToldState:
        other = next((since for since, f in first if f != front), None)
        d = self._fronts.get(front)
        holds = d is not None and d.outstanding > 0
        idle = self.idle and (other is None or (holds and d is not None and d.holds_since < other))
        return ToldState(idle, self.shared, self.starts, self.idle)

    def running_for_s(self) -> float:
        """How long the running batch has run (0 while none runs)."""
        return self.clock.now() - self._started_at if self.held else 0.0

    def free(self) -> int:
        if any(d.legacy for d in self._fronts.values()):
            return 0
        return self.cap - self.held - sum(d.outstanding for d in self._fronts.values())

    def grant(self, eligible: Collection[Hashable] | None = None) -> dict[Hashable, int]:
        """Hand out the free slots now, to the `eligible` front ends only (None: any); returns who was
        granted how many (already counted as theirs)."""
        free = self.free()
        if free <= 0 or not self._fronts:
            return {}
        if not self.shared:
            (front, d), *_ = self._fronts.items()
            if eligible is not None and front not in eligible:
                return {}
            self._hold(d, free)
            return {front: free}
        now = self.clock.now()
        wanting = [
            (f, d) for f, d in self._fronts.items()
            if d.queued > 0 and d.outstanding == 0 and (eligible is None or f in eligible)
        ]
        wanting.sort(key=lambda fd: (-(fd[1].oldest_age_s + now - fd[1].reported_at), -fd[1].queued))
        out: dict[Hashable, int] = {}
        for front, d in wanting[:free]:
            self._hold(d, 1)
            out[front] = 1
        return out

    def _hold(self, d: FrontDemand, slots: int) -> None:
        if not d.outstanding:
            d.holds_since = self._granted
            d.held_at = self.clock.now()
        d.outstanding += slots
        self._granted += slots

    def to_tell(self, told: Mapping[Hashable, ToldState | None]) -> dict[Hashable, tuple[int, ToldState]]:
        """Hand out the free slots (`grant`) and say who gets a Credit now, with how many slots and the
        state (`state_for`): those granted some, and, when their state changed since they were last
        `told` it, those holding slots, never told, or told another sharing. `told`: each front end that
        takes credits; only they are granted slots (a front end left out, e.g. of a draining model server
        of a pool worker, gets none)."""
        grants = self.grant(told.keys())
        first = self._first_holders()
        out: dict[Hashable, tuple[int, ToldState]] = {}
        for front, last in told.items():
            granted = grants.get(front, 0)
            state = self._state(front, first)
            if granted or (
                last != state and (self.outstanding(front) > 0 or last is None or last.shared != state.shared)
            ):
                out[front] = (granted, state)
        return out

    def statistics(self) -> CreditStatistics:
        return CreditStatistics(
            len(self._fronts),
            self.held,
            sum(d.outstanding for d in self._fronts.values()),
            self.high_water,
            self._granted,
            self._returned,
        )


def _first(holder: tuple[int, Hashable]) -> int:
    return holder[0]


class Seat:
    """One model server's share of a pool worker's ledger (worker/holdings.py): the `CreditLedger` surface a
    `Worker` uses, its front ends keyed (seat, index) in the one ledger of the device the pool worker's
    models share. So the cap (1 running + 1 staged) holds across the models, and what each front end is
    told (idle, what runs and for how long) is the device's, whichever model's batch it is. `on_held` is
    told each batch the seat's model holds (+1 when received, -1 when finished): a model holding batches
    is busy (never evicted)."""

    def __init__(self, ledger: CreditLedger, name: Hashable, on_held: Callable[[int], None]) -> None:
        self.ledger = ledger
        self.name = name
        self.on_held = on_held
        self.held = 0
        """This model's batches held (received and not finished)."""
        self._joined: set[int] = set()

    @property
    def clock(self) -> Clock:
        return self.ledger.clock

    @property
    def high_water(self) -> int:
        return self.ledger.high_water

    @property
    def shared(self) -> bool:
        return self.ledger.shared

    @property
    def idle(self) -> bool:
        return self.ledger.idle

    @property
    def running_items(self) -> int:
        return self.ledger.running_items

    def running_for_s(self) -> float:
        return self.ledger.running_for_s()

    def key(self, index: int) -> tuple[Hashable, int]:
        return (self.name, index)

    def accepts(self, credits: bool) -> bool:
        return self.ledger.accepts(credits)

    def join(self, index: int, legacy: bool = False) -> None:
        self._joined.add(index)
        self.ledger.join(self.key(index), legacy)

    def leave(self, index: int) -> None:
        self._joined.discard(index)
        self.ledger.leave(self.key(index))

    def outstanding(self, index: int) -> int:
        return self.ledger.outstanding(self.key(index))

    def report(self, index: int, queued: int, oldest_age_s: float, returned: int = 0) -> None:
        self.ledger.report(self.key(index), queued, oldest_age_s, returned)

    def received(self, index: int, items: int = 0) -> None:
        self.ledger.received(self.key(index), items)
        self.held += 1
        self.on_held(1)

    def finished(self) -> None:
        self.ledger.finished()
        if self.held:
            self.held -= 1
            self.on_held(-1)

    def state_for(self, index: int) -> ToldState:
        return self.ledger.state_for(self.key(index))

    def close(self) -> None:
        """Its model server has ended: its front ends leave, and the batches it still counted (dropped
        unstarted when its links were lost) free their slots."""
        for index in list(self._joined):
            self.leave(index)
        while self.held:
            self.finished()
