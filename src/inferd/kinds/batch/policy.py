"""When to cut a batch. A plain object: no I/O, no clock of its own (the caller passes `now`).

The rules (ROADMAP Part 1, "what measuring the peers taught us"):

* A batch is cut only when a worker can take it.
* An idle worker takes a batch when it is full, when a preferred size can be formed, or when the
  oldest queued item has waited `max_wait` (so a lone request at low load waits at most `max_wait`).
  When a worker frees and the oldest item has already waited `max_wait`, the batch goes at once:
  no fresh window is opened.
* A busy worker with a free staging slot takes only a full batch (hiding the IPC round trip without
  cutting small batches while the device is busy: they keep filling instead), and only near the end of
  its running batch (`stage_at`: STAGE_LEAD before its expected finish). A batch staged as soon as the
  running one starts would be fixed a whole batch early: an item arriving meanwhile (a light tenant's,
  which fair order puts in the very next cut) would wait for the rest of the running batch, all of the
  staged one, then its own. Staged late, the cut takes it, and the lead still hides the round trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class CutDecision:
    """`size` > 0: cut that many items now (for an idle worker if `idle`, else for a staging slot); if
    `since` is set (SLO batching), the items enqueued at or after it go first, oldest first, and only then
    the older ones, which can no longer meet the SLO. `size` == 0: cut nothing; re-decide at `wake_at` (if
    set) or on the next event; arrivals are such an event only once `wake_queued` items are queued (None:
    arrivals alone cannot change this decision, only a worker or the clock can)."""

    size: int
    idle: bool = True
    wake_at: float | None = None
    since: float | None = None
    wake_queued: int | None = 1


NOTHING = CutDecision(0)

STAGE_LEAD_FRACTION = 0.1
"""A batch is staged this fraction of the running batch's expected duration before its finish ..."""
STAGE_LEAD_MIN_S = 0.01
"""... but never later than this before it (the round trip and the worker's decoding of the batch)."""


def stage_time(running_since: float, expected_s: float | None) -> float:
    """When a busy worker whose running batch started at `running_since` and should take `expected_s`
    (None: not measured yet, stage at once) may have its next batch staged."""
    if expected_s is None:
        return running_since
    return running_since + expected_s - max(STAGE_LEAD_MIN_S, STAGE_LEAD_FRACTION * expected_s)


class CutPolicy(Protocol):
    """What the Dispatcher asks when a batch may be due: BatchPolicy (fixed size and wait) or
    SloBatchPolicy (kinds/batch/slo_policy.py: both chosen from the latency SLO)."""

    def decide(
        self,
        now: float,
        queued: int,
        oldest_at: float | None,
        idle_workers: int,
        stage_slots: int,
        stage_at: float | None = None,
    ) -> CutDecision: ...

    def lost_before(self, now: float) -> float | None:
        """Queued items enqueued before this are to be shed (SLO batching with shed_lost); None: keep all."""
        ...


class BatchPolicy:
    def __init__(self, max_batch_size: int, max_wait_s: float, preferred_batch_sizes: tuple[int, ...] = ()):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.preferred = tuple(sorted({p for p in preferred_batch_sizes if 1 <= p <= max_batch_size}))

    def decide(
        self,
        now: float,
        queued: int,
        oldest_at: float | None,
        idle_workers: int,
        stage_slots: int,
        stage_at: float | None = None,
    ) -> CutDecision:
        """`queued` live items, the oldest enqueued at `oldest_at`; `idle_workers` have nothing running,
        `stage_slots` are free staging slots on busy workers, the first of which may be filled from
        `stage_at` (`stage_time`; None: now)."""
        if queued <= 0 or oldest_at is None:
            return NOTHING
        full = min(queued, self.max_batch_size)
        if idle_workers > 0:
            if queued >= self.max_batch_size:
                return CutDecision(self.max_batch_size)
            due_at = oldest_at + self.max_wait_s
            if now >= due_at:
                return CutDecision(full)
            preferred = self._largest_preferred(queued)
            if preferred:
                return CutDecision(preferred)
            return CutDecision(0, wake_at=due_at, wake_queued=self._next_size(queued))
        if stage_slots > 0 and queued >= self.max_batch_size:
            if stage_at is not None and now < stage_at:
                return CutDecision(0, wake_at=stage_at, wake_queued=None)
            return CutDecision(self.max_batch_size, idle=False)
        # a staging slot takes only a full batch; with no free slot at all, only a worker frees one
        return CutDecision(0, wake_queued=self.max_batch_size if stage_slots > 0 else None)

    def lost_before(self, now: float) -> float | None:
        return None

    def _next_size(self, queued: int) -> int:
        """The queue length at which an idle worker's batch is due before max_wait: the next preferred
        size above `queued`, else full."""
        for p in self.preferred:
            if p > queued:
                return p
        return self.max_batch_size

    def _largest_preferred(self, queued: int) -> int:
        best = 0
        for p in self.preferred:
            if p <= queued:
                best = p
        return best
