"""The bounded per-model queue of batch items. No I/O; the caller passes `now`.

Items are withdrawn lazily (a caller that leaves marks its item; the cut skips it), so withdrawal is
O(1). The physical deques are compacted when dead entries pile up, so they stay bounded too.

Inside a priority class each tenant has its own FIFO lane; the cut serves the lanes in weighted fair
order and a full queue makes room for a tenant within its share (routing/fairness.py). Without tenants
there is one lane per class: plain FIFO. A cut with `since` (SLO batching only) takes the items enqueued
at or after it first, from the lanes' tails, and unlinks them there.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from inferd.routing.fairness import BULK, INTERACTIVE, NO_TENANT, FairOrder, TenantShare, displacement


class ItemState(enum.Enum):
    QUEUED = "queued"
    HELD = "held"
    """Outside the queue, waiting to run in an isolation batch of its own."""
    RUNNING = "running"
    DONE = "done"
    WITHDRAWN = "withdrawn"
    EXPIRED = "expired"

    TERMINAL: frozenset[ItemState]


ItemState.TERMINAL = frozenset({ItemState.DONE, ItemState.WITHDRAWN, ItemState.EXPIRED})


@dataclass(slots=True, eq=False)
class QueuedItem:
    """One batch item: one row of one request."""

    payload: Any
    enqueued_at: float
    deadline: float | None
    reply: Any = None
    """Whatever the driver uses to answer the caller (an asyncio.Future in the runtime)."""
    priority: int = INTERACTIVE
    """INTERACTIVE (0) or BULK (1): bulk uses spare capacity and is shed first."""
    attempts: int = 0
    """Runs started on a worker."""
    crashes: int = 0
    """Runs that ended with the worker crashing or hanging."""
    isolation_round: int = 0
    """How many times this item's batch was halved to find a failing input."""
    state: ItemState = ItemState.QUEUED
    first_enqueued_at: float = field(default=0.0)
    batch_id: int = 0
    """The batch that answers for this item now (0 while queued). A hedged item may also sit in an
    older batch on a slow worker: only the owning batch's loss recovers it."""
    hedged: bool = False
    """Already sent to a second worker once because its first was slow: never hedged again."""
    tenant: TenantShare = NO_TENANT
    """Whose request this is: its lane in the queue and its weight there."""
    request: int = 0
    """Items of one request share it (0: not known), so they give up their places together."""
    trace: Any = None
    """The request's span when tracing is on and its trace is sampled (observability/tracing.py)."""

    def __post_init__(self) -> None:
        if not self.first_enqueued_at:
            self.first_enqueued_at = self.enqueued_at


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    live: int
    """Items waiting (what the bound counts)."""
    physical: int
    """Entries held, withdrawn ones not yet compacted included."""
    max_size: int


class _Lanes:
    """One priority class: a FIFO lane of items per tenant, served in `FairOrder`."""

    def __init__(self) -> None:
        self.lanes: dict[str, deque[QueuedItem]] = {}
        self.held: dict[str, int] = {}
        """Live items per tenant (tenants with none are absent)."""
        self.order = FairOrder()
        self.live = 0

    def add(self, item: QueuedItem, front: bool = False) -> None:
        name = item.tenant.name
        lane = self.lanes.get(name)
        if lane is None:
            lane = self.lanes[name] = deque()
        if front:
            lane.appendleft(item)
        else:
            lane.append(item)
        held = self.held.get(name, 0)
        self.held[name] = held + 1
        self.live += 1
        if not held:
            self.order.join(name, item.tenant.weight)

    def dropped(self, item: QueuedItem) -> None:
        """A queued item left its lane (taken, withdrawn or displaced): count it off."""
        name = item.tenant.name
        self.live -= 1
        self.held[name] -= 1
        if not self.held[name]:
            del self.held[name], self.lanes[name]  # what is left in the lane is dead
            self.order.leave(name)

    def take(self, size: int, now: float, batch: list[QueuedItem], expired: list[QueuedItem]) -> None:
        while self.live and len(batch) < size:
            alone = len(self.held) == 1  # one tenant waiting (always, without tenants): plain FIFO
            name = next(iter(self.held)) if alone else self.order.next()
            lane = self.lanes[name]
            item = lane.popleft()
            while item.state is not ItemState.QUEUED:  # the tenant holds a live item: it comes
                item = lane.popleft()
            if item.deadline is not None and item.deadline <= now:
                item.state = ItemState.EXPIRED  # uses no slot: not charged
                expired.append(item)
            else:
                item.state = ItemState.RUNNING
                batch.append(item)
                if not alone:  # a lone tenant's pass is never compared: charging it changes nothing
                    self.order.charge(name)
            self.dropped(item)

    def take_since(
        self, size: int, now: float, since: float, batch: list[QueuedItem], expired: list[QueuedItem]
    ) -> None:
        """As `take`, from the items enqueued at or after `since` only (`fresh`); older ones stay queued."""
        fresh = {name: deque(items) for name, items in self.fresh(since).items() if items}
        taken: dict[str, int] = {}
        while fresh and len(batch) < size:
            name = next(iter(fresh)) if len(fresh) == 1 else min(fresh, key=self.order.pass_of)
            item = fresh[name].popleft()
            if not fresh[name]:
                del fresh[name]
            if item.deadline is not None and item.deadline <= now:
                item.state = ItemState.EXPIRED
                expired.append(item)
            else:
                item.state = ItemState.RUNNING
                batch.append(item)
                if len(self.held) > 1:
                    self.order.charge(name)
            taken[name] = taken.get(name, 0) + 1
            self.dropped(item)
        for name, count in taken.items():
            self._unlink(name, count)

    def _unlink(self, name: str, count: int) -> None:
        """Remove the `count` items just taken from the tail part of the lane (a retry may put them back
        at the head later: the lane must not hold them twice)."""
        lane = self.lanes.get(name)
        if lane is None:  # the tenant has nothing left: the lane went with its last item
            return
        kept: list[QueuedItem] = []
        while count and lane:
            item = lane.pop()
            if item.state is ItemState.QUEUED:
                kept.append(item)
            elif item.state is ItemState.RUNNING or item.state is ItemState.EXPIRED:
                count -= 1  # one of the items taken (dead entries are dropped on the way)
        lane.extend(reversed(kept))

    def fresh(self, since: float) -> dict[str, list[QueuedItem]]:
        """Per tenant, its live items enqueued at or after `since`, oldest first: the lane's tail back to
        the first live item enqueued before `since` (items put back at the head are never fresh)."""
        out: dict[str, list[QueuedItem]] = {}
        for name, lane in self.lanes.items():
            items: list[QueuedItem] = []
            for item in reversed(lane):
                if item.state is not ItemState.QUEUED:
                    continue
                if item.enqueued_at < since:
                    break
                items.append(item)
            items.reverse()
            out[name] = items
        return out

    def newest(self, name: str, count: int) -> list[QueuedItem]:
        """Take out the newest `count` live items of tenant `name`, and the rest of the last one's
        request (the request fails as a whole: its other items would only run for nobody)."""
        lane = self.lanes[name]
        out: list[QueuedItem] = []
        while lane:
            tail = lane[-1]
            if tail.state is ItemState.QUEUED:
                if len(out) >= count and not (tail.request and tail.request == out[-1].request):
                    break
                tail.state = ItemState.WITHDRAWN
                out.append(tail)
                self.dropped(tail)
            lane.pop()
        return out

    def oldest(self) -> QueuedItem | None:
        heads = []
        for lane in self.lanes.values():
            while lane and lane[0].state is not ItemState.QUEUED:
                lane.popleft()
            if lane:
                heads.append(lane[0])
        return min(heads, key=lambda i: i.enqueued_at) if heads else None

    def oldest_at(self) -> float | None:
        head = self.oldest()
        return None if head is None else head.enqueued_at

    def items(self) -> list[QueuedItem]:
        return [i for lane in self.lanes.values() for i in lane if i.state is ItemState.QUEUED]

    def physical(self) -> int:
        return sum(len(lane) for lane in self.lanes.values())

    def compact(self) -> None:
        for name, lane in self.lanes.items():
            self.lanes[name] = deque(i for i in lane if i.state is ItemState.QUEUED)


class RequestQueue:
    """Live items with a hard bound on their number, in two priority classes.

    Interactive items (class 0) always leave before bulk ones (class 1): a cut takes interactive work
    first and fills the space it leaves with bulk work, so interactive work never waits behind bulk.
    Within a class each tenant's items leave in FIFO order, tenants in weighted fair order.
    """

    CLASSES = (INTERACTIVE, BULK)

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self._classes = (_Lanes(), _Lanes())
        self.last_arrival: list[float | None] = [None, None]
        """Per class, when its latest new item arrived (retries put back do not count)."""

    def __len__(self) -> int:
        return self._classes[0].live + self._classes[1].live

    def live_in(self, priority: int) -> int:
        return self._classes[priority].live

    def held_in(self, priority: int) -> dict[str, int]:
        """Live items per tenant in a class (a copy)."""
        return dict(self._classes[priority].held)

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(len(self), sum(c.physical() for c in self._classes), self.max_size)

    def live_items(self) -> list[QueuedItem]:
        """The queued items, by class, tenant and age (a copy: for inspection, not the hot path)."""
        return [i for c in self._classes for i in c.items()]

    def free(self) -> int:
        return self.max_size - len(self)

    def oldest(self) -> QueuedItem | None:
        """The live item that has waited longest, of any class."""
        heads = [i for i in (c.oldest() for c in self._classes) if i is not None]
        return min(heads, key=lambda i: i.enqueued_at) if heads else None

    def oldest_at(self) -> float | None:
        head = self.oldest()
        return None if head is None else head.enqueued_at

    def oldest_in(self, priority: int) -> float | None:
        return self._classes[priority].oldest_at()

    def push(self, item: QueuedItem) -> None:
        if len(self) >= self.max_size:
            raise OverflowError(f"queue full ({len(self)}/{self.max_size}): admit before pushing")
        item.state = ItemState.QUEUED
        self._classes[item.priority].add(item)
        self.last_arrival[item.priority] = item.enqueued_at

    def push_front(self, items: Iterable[QueuedItem]) -> None:
        """Put items back at the head of their lane, in their original order (retries). May exceed the
        bound transiently: these items were admitted before and are owed an answer."""
        for item in reversed(list(items)):
            item.state = ItemState.QUEUED
            self._classes[item.priority].add(item, front=True)

    def room_for(self, tenant: TenantShare, n: int, priority: int, capacity: int) -> dict[str, int] | None:
        """Can `n` items of `tenant` join class `priority`, which may fill the queue up to `capacity`?
        {}: they fit; None: they do not; else how many newest items of which tenants must make room
        (routing/fairness.py `displacement`)."""
        free = capacity - len(self)
        if n <= free:  # (displacement's own first answer, without copying the lanes' weights)
            return {}
        lanes = self._classes[priority]
        room = capacity - (len(self) - lanes.live)  # the other class's items take room too
        return displacement(tenant, n, free, room, lanes.held, lanes.order.weights())

    def displace(self, priority: int, taken: dict[str, int]) -> list[QueuedItem]:
        """Take out the newest items `room_for` named; the caller answers them (they are WITHDRAWN)."""
        lanes = self._classes[priority]
        return [item for name, count in taken.items() for item in lanes.newest(name, count)]

    def withdraw(self, item: QueuedItem) -> bool:
        """Remove a queued item (its caller left or timed out). False if it was not queued."""
        if item.state is not ItemState.QUEUED:
            return False
        item.state = ItemState.WITHDRAWN
        lanes = self._classes[item.priority]
        lanes.dropped(item)
        lane = lanes.lanes.get(item.tenant.name)
        if lane is not None and len(lane) > 2 * self.max_size + 64:
            lanes.compact()
        return True

    def cut(
        self, size: int, now: float, since: float | None = None
    ) -> tuple[list[QueuedItem], list[QueuedItem]]:
        """Take up to `size` live items, interactive first, each class in fair order. Items whose deadline
        has passed are taken out too, into the second list, so they never occupy a batch slot. `since`
        (SLO batching): within each class, the items enqueued at or after it first, oldest first, then the
        oldest others; interactive items, lost or not, before bulk ones."""
        batch: list[QueuedItem] = []
        expired: list[QueuedItem] = []
        for lanes in self._classes:  # a class's lost items still go before the next class's (bulk) items
            if since is not None:
                lanes.take_since(size, now, since, batch, expired)
            lanes.take(size, now, batch, expired)
        return batch, expired

    def count_since(self, since: float) -> int:
        """How many live items were enqueued at or after `since` (admission under SLO batching: the items
        a new one waits behind), counted from the lanes' tails without copying them."""
        count = 0
        for lanes in self._classes:
            for lane in lanes.lanes.values():
                for item in reversed(lane):
                    if item.state is not ItemState.QUEUED:
                        continue
                    if item.enqueued_at < since:
                        break
                    count += 1
        return count

    def times_since(self, since: float) -> list[float]:
        """When the live items that a cut with `since` would choose from were enqueued, oldest first."""
        times = [i.enqueued_at for c in self._classes for items in c.fresh(since).values() for i in items]
        times.sort()
        return times

    def enqueued_before(self, before: float, priority: int) -> list[QueuedItem]:
        """The live items of a class enqueued before `before`: each lane's head, up to its first later item.
        A lane is in enqueue order but for items put back at its head (retries, hedges, an SLO cut's
        newer items given back): behind a newer one put back, older items are found once it has left."""
        found = []
        for lane in self._classes[priority].lanes.values():
            for item in lane:
                if item.state is not ItemState.QUEUED:
                    continue
                if item.enqueued_at >= before:
                    break
                found.append(item)
        return found

    def drain_all(self) -> list[QueuedItem]:
        """Take out every live item (shutdown, model unavailable)."""
        live = self.live_items()
        self._classes = (_Lanes(), _Lanes())
        for item in live:
            item.state = ItemState.WITHDRAWN  # out of the queue: nothing may count it off again
        return live
