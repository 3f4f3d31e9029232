"""Short-window burn rates of one SLO, computed in the process: a plain object on an injected clock, no
I/O. Events go into fixed time slots; a window's burn rate is its bad share over the error budget.

Only short windows (minutes) are kept here, for dashboards and `/metrics` readers that want a burn rate
without a Prometheus server. The alerting rules compute every window, long ones included, from the
`inferd_slo_events_total` counters, so a restart loses nothing they need.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inferd.clock import Clock

SHORT_WINDOWS_S: dict[str, float] = {"5m": 300.0, "30m": 1800.0}
"""The in-process windows, by the label their gauge carries."""


@dataclass(frozen=True, slots=True)
class WindowCounts:
    good: int
    bad: int

    @property
    def total(self) -> int:
        return self.good + self.bad


class BurnWindow:
    """Good and bad events of one SLO over the last `span_s`, in slots of `slot_s` (a window's edge is
    exact to one slot)."""

    def __init__(
        self, clock: Clock, error_budget: float, span_s: float = 1800.0, slot_s: float = 10.0
    ) -> None:
        if not 0.0 < error_budget < 1.0:
            raise ValueError(f"error budget {error_budget} must lie strictly between 0 and 1")
        if not 0.0 < slot_s <= span_s:
            raise ValueError(f"slot_s ({slot_s}) must be positive and at most span_s ({span_s})")
        self.clock = clock
        self.error_budget = error_budget
        self.slot_s = slot_s
        self.slots = int(-(-span_s // slot_s))
        self._slots: deque[list[int]] = deque()
        """[slot number, good, bad], oldest first; only slots that saw events."""

    def add(self, good: bool, n: int = 1) -> None:
        """`n` events happened now, all good or all bad."""
        slot = int(self.clock.now() // self.slot_s)
        if not self._slots or self._slots[-1][0] != slot:
            self._slots.append([slot, 0, 0])
            self._expire(slot)
        self._slots[-1][1 if good else 2] += n

    def counts(self, window_s: float) -> WindowCounts:
        """Events of the last `window_s` (whole slots, the current one included)."""
        now_slot = int(self.clock.now() // self.slot_s)
        self._expire(now_slot)
        first = now_slot - int(-(-window_s // self.slot_s)) + 1
        good = bad = 0
        for slot, g, b in reversed(self._slots):
            if slot < first:
                break
            good += g
            bad += b
        return WindowCounts(good, bad)

    def burn_rate(self, window_s: float) -> float:
        """Bad share of the window's events over the error budget: 1 spends the budget exactly over the
        SLO period; 0 with no events."""
        c = self.counts(window_s)
        return 0.0 if c.total == 0 else (c.bad / c.total) / self.error_budget

    def _expire(self, now_slot: int) -> None:
        while self._slots and self._slots[0][0] <= now_slot - self.slots:
            self._slots.popleft()
