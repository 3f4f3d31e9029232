"""The owner's record of its followers, for the syncs that wait on them: each follower's latest report
and when it came (`FollowerReports`), and waiting until no follower up lags (`until`).

A follower counts as up while its last report is at most `live_s` old. One that dies sends no report
to say so: `until` looks again at least every RECHECK_S, so it stops counting `live_s` after its last
report, not at the wait's end. Used by version_sync.py (model versions), config_sync.py (config
reloads), each with its own report type and questions (the search indexes' reports are documents in
the shared store: kinds/search/shared_indexes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Generic, TypeVar

from inferd.clock import Clock

LIVE_S = 2.0
"""A follower that reported within this long counts as up: the owner waits for it."""
RECHECK_S = 0.25

T = TypeVar("T")


class FollowerReports(Generic[T]):
    """Each follower's latest report (a `T`) and when it came. Plain but for `changed`, the event a
    waiting owner wakes on."""

    def __init__(self, clock: Clock, live_s: float = LIVE_S) -> None:
        self.clock = clock
        self.live_s = live_s
        self.reports: dict[int, tuple[float, T]] = {}
        self.changed = asyncio.Event()

    def report(self, follower: int, value: T) -> None:
        self.reports[follower] = (self.clock.now(), value)
        self.changed.set()
        self.changed = asyncio.Event()

    def live(self) -> list[tuple[int, T]]:
        """(follower, its report) of the followers up, by follower."""
        now = self.clock.now()
        return sorted(((i, v) for i, (at, v) in self.reports.items() if now - at <= self.live_s), key=_first)

    async def until(self, waiting: Callable[[], list[int]], wait_s: float) -> bool:
        """Until nobody is `waiting()` (the followers up that lag), looked at on every report and at
        least every RECHECK_S; False when some still are after `wait_s`."""
        try:
            async with asyncio.timeout(wait_s):
                while waiting():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), RECHECK_S)
        except TimeoutError:
            return not waiting()
        return True


def _first(item: tuple[int, object]) -> int:
    return item[0]
