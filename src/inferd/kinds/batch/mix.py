"""How big a batch may be while interactive and bulk work share a model: a plain policy object (no I/O, the
clock's time passed in).

Interactive latency under bulk load is what an interactive request waits for a worker to come free,
plus its own batch. Two rules keep both short while bulk keeps the devices full:

- **Cap.** While interactive traffic is active (queued now, or arrived within two full-batch times), a
  batch may cost at most `mixed_batch_cost_ratio` of a full batch (cost from the measured cost line).
  Interactive items always go first; bulk fills the rest of the cap.
- **Stagger.** Workers that start equal batches together also finish together, and a request arriving
  just after waits a whole batch. So within [half the cap, the cap] the batch size is chosen so this
  worker's finish lands farthest from the other workers' expected finishes (and their next ones): with
  N workers finishes drift apart until a worker comes free about every cap/N, and an interactive request
  waits at most about that long.

Without interactive traffic, or without bulk work to fill with, batches are full: bulk alone runs at
full efficiency.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STAGGER_CANDIDATES = 9
"""Durations tried between the smallest and the largest allowed batch."""


@dataclass(frozen=True, slots=True)
class MixInput:
    now: float
    interactive_queued: int
    bulk_queued: int
    last_interactive_at: float | None
    """When the latest interactive item arrived (None: never)."""
    cost_line: tuple[float, float] | None
    """(base, per item) seconds of a batch, measured; None until known."""
    other_finishes: Sequence[float]
    """Expected finish times of the other workers' current work."""


class MixPolicy:
    def __init__(self, max_batch_size: int, mixed_batch_cost_ratio: float) -> None:
        if not 0.0 < mixed_batch_cost_ratio <= 1.0:
            raise ValueError(f"mixed_batch_cost_ratio must be in (0, 1], got {mixed_batch_cost_ratio}")
        self.max_batch_size = max_batch_size
        self.ratio = mixed_batch_cost_ratio

    def cap(self, s: MixInput) -> int:
        """Most items the next batch may hold (never fewer than its interactive items, up to full)."""
        size = self.max_batch_size
        if s.bulk_queued == 0 or s.cost_line is None:
            return size
        base, per_item = s.cost_line
        full = base + per_item * size
        active = s.interactive_queued > 0 or (
            s.last_interactive_at is not None and s.now - s.last_interactive_at <= 2 * full
        )
        if not active or per_item <= 0:
            return size
        longest = self.ratio * full
        cap_items = min(size, int((longest - base) / per_item))
        if cap_items < size // 2:
            return size  # batches cost nearly the same at any size: a cap would only cut throughput
        shortest = base + per_item * max(1, cap_items // 2)
        duration = stagger(s.now, shortest, base + per_item * cap_items, s.other_finishes)
        items = max(1, min(size, round((duration - base) / per_item)))
        return max(items, min(s.interactive_queued, size))


def stagger(now: float, shortest: float, longest: float, others: Sequence[float]) -> float:
    """The duration in [shortest, longest] whose finish lies farthest from every other worker's expected
    finish and the one after it (a batch of `longest` later); ties go to the longer batch."""
    if not others or longest <= shortest:
        return longest
    marks = [f for f in others] + [f + longest for f in others]
    best, best_gap = longest, -1.0
    for k in range(STAGGER_CANDIDATES - 1, -1, -1):
        d = shortest + (longest - shortest) * k / (STAGGER_CANDIDATES - 1)
        gap = min(abs(now + d - m) for m in marks)
        if gap > best_gap + 1e-9:
            best, best_gap = d, gap
    return best
