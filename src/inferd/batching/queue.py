"""The bounded per-model queue of batch items. No I/O; the caller passes `now`.

Items are withdrawn lazily (a caller that leaves marks its item; the cut skips it), so withdrawal is
O(1). The physical deque is compacted when dead entries pile up, so it stays bounded too.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


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


INTERACTIVE = 0
BULK = 1
PRIORITY_NAMES = {"interactive": INTERACTIVE, "bulk": BULK}


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


class RequestQueue:
    """FIFO of live items with a hard bound on their number, in two priority classes.

    Interactive items (class 0) always leave before bulk ones (class 1): a cut takes interactive work
    first and fills the space it leaves with bulk work, so interactive work never waits behind bulk.
    """

    CLASSES = (INTERACTIVE, BULK)

    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self._classes: tuple[deque[QueuedItem], deque[QueuedItem]] = (deque(), deque())
        self._live = [0, 0]
        self.last_arrival: list[float | None] = [None, None]
        """Per class, when its latest new item arrived (retries put back do not count)."""

    def __len__(self) -> int:
        return self._live[0] + self._live[1]

    def live_in(self, priority: int) -> int:
        return self._live[priority]

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(len(self), sum(len(q) for q in self._classes), self.max_size)

    def live_items(self) -> list[QueuedItem]:
        """The queued items in the order they would leave (a copy: for inspection, not the hot path)."""
        return [i for q in self._classes for i in q if i.state is ItemState.QUEUED]

    def free(self) -> int:
        return self.max_size - len(self)

    def oldest_at(self) -> float | None:
        heads = []
        for q in self._classes:
            self._trim_head(q)
            if q:
                heads.append(q[0].enqueued_at)
        return min(heads) if heads else None

    def oldest_in(self, priority: int) -> float | None:
        q = self._classes[priority]
        self._trim_head(q)
        return q[0].enqueued_at if q else None

    def push(self, item: QueuedItem) -> None:
        if len(self) >= self.max_size:
            raise OverflowError(f"queue full ({len(self)}/{self.max_size}): admit before pushing")
        item.state = ItemState.QUEUED
        self._classes[item.priority].append(item)
        self._live[item.priority] += 1
        self.last_arrival[item.priority] = item.enqueued_at

    def push_front(self, items: Iterable[QueuedItem]) -> None:
        """Put items back at the head of their class, in their original order (retries). May exceed the
        bound transiently: these items were admitted before and are owed an answer."""
        for item in reversed(list(items)):
            item.state = ItemState.QUEUED
            self._classes[item.priority].appendleft(item)
            self._live[item.priority] += 1

    def withdraw(self, item: QueuedItem) -> bool:
        """Remove a queued item (its caller left or timed out). False if it was not queued."""
        if item.state is not ItemState.QUEUED:
            return False
        item.state = ItemState.WITHDRAWN
        self._live[item.priority] -= 1
        q = self._classes[item.priority]
        if len(q) > 2 * self.max_size + 64:
            self._classes = tuple(  # type: ignore[assignment]
                deque(i for i in c if i.state is ItemState.QUEUED) for c in self._classes
            )
        return True

    def cut(self, size: int, now: float) -> tuple[list[QueuedItem], list[QueuedItem]]:
        """Take up to `size` live items, interactive first, each class from its head. Items whose deadline
        has passed are taken out too, into the second list, so they never occupy a batch slot."""
        batch: list[QueuedItem] = []
        expired: list[QueuedItem] = []
        for priority in self.CLASSES:
            self._take(priority, size, now, batch, expired)
        return batch, expired

    def _take(
        self,
        priority: int,
        size: int,
        now: float,
        batch: list[QueuedItem],
        expired: list[QueuedItem],
    ) -> None:
        items = self._classes[priority]
        while items and len(batch) < size:
            item = items.popleft()
            if item.state is not ItemState.QUEUED:
                continue
            self._live[priority] -= 1
            if item.deadline is not None and item.deadline <= now:
                item.state = ItemState.EXPIRED
                expired.append(item)
                continue
            item.state = ItemState.RUNNING
            batch.append(item)

    def drain_all(self) -> list[QueuedItem]:
        """Take out every live item (shutdown, model unavailable)."""
        live = self.live_items()
        for q in self._classes:
            q.clear()
        self._live = [0, 0]
        for item in live:
            item.state = ItemState.WITHDRAWN  # out of the queue: nothing may count it off again
        return live

    @staticmethod
    def _trim_head(items: deque[QueuedItem]) -> None:
        while items and items[0].state is not ItemState.QUEUED:
            items.popleft()
