"""The simulation's event queue: callbacks ordered by virtual time (ties in scheduling order), driving a
FakeClock, the same Clock every inferd policy object takes. Nothing here sleeps or does I/O."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

from inferd.clock import FakeClock


class EventQueue:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.processed = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` at virtual time `t` (now, if `t` is in the past)."""
        heapq.heappush(self._heap, (max(t, self.clock.now()), next(self._order), fn, args))

    def run_until(self, end: float) -> None:
        """Process every event due by `end`, advancing the clock to each; the clock ends at `end`."""
        heap = self._heap
        clock = self.clock
        while heap and heap[0][0] <= end:
            t, _, fn, args = heapq.heappop(heap)
            if t > clock.now():
                clock.advance(t - clock.now())
            fn(*args)
            self.processed += 1
        if end > clock.now():
            clock.advance(end - clock.now())

    def __len__(self) -> int:
        return len(self._heap)
