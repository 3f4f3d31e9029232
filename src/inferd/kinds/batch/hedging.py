"""When a batch on a slow worker is hedged to other workers. A plain object with an injected clock, no I/O:
`decide` returns a `HedgeDecision` value (or None) and the watchdog carries it out.

The rule: a batch running over HEDGE_FACTOR x its expected time (from the fleet's cost line), and slow
against the other workers too (a fleet-wide slowdown is not hedged: copies would only add load), with
another ready worker to take the copies. The batch and those staged behind it are marked hedged, so they
are decided on once; the worker is reported overdue to the ejector (ejected at once if the share allows).
The first answer wins; inference is idempotent, so a model that is not gets no hedges.

Bounded: an item is hedged at most once and within max_attempts; items under suspicion (they crashed a
worker before, or are being isolated as a possible poison input) are never hedged, so a hanging input is
not spread over the fleet and isolation is never undone. Running items spend the retry budget (all or
none); staged items, which never started, go back free (as when a worker is lost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferd.clock import Clock
from inferd.kinds.batch.delivery import owned
from inferd.kinds.batch.queue import QueuedItem
from inferd.routing import OutlierEjector
from inferd.routing.retry import RetryBudget
from inferd.wire.connection import Batch

HEDGE_FACTOR = 3.0
"""A batch running this many times its expected time is hedged to other workers."""


@dataclass(frozen=True, slots=True)
class HedgeInput:
    """One busy worker, as the watchdog sees it."""

    worker_id: str
    batches: Sequence[Batch]
    """What it holds: the running batch first, then the staged ones."""
    running_since: float
    """When its running batch reached the device."""
    others_ready: bool
    """Another ready worker could take the copies."""
    cost_line: tuple[float, float] | None
    """(base, per item) seconds of a batch, measured; None until known."""
    idempotent: bool
    max_attempts: int


@dataclass(frozen=True, slots=True)
class HedgeDecision:
    """Hedge this worker's batches: mark `batches` hedged, report the worker overdue after `age_s`, and
    queue `items` again at the head (in this order). `items` may be empty: nothing was left to hedge."""

    worker_id: str
    age_s: float
    expected_s: float
    batches: tuple[Batch, ...]
    items: tuple[QueuedItem, ...]
    retried: int
    """Items of the running batch among `items`: the retries it spent from the budget."""


class HedgePolicy:
    def __init__(
        self, clock: Clock, budget: RetryBudget, ejector: OutlierEjector, factor: float = HEDGE_FACTOR
    ) -> None:
        if factor <= 1.0:
            raise ValueError(f"hedge factor must be > 1, got {factor}")
        self.clock = clock
        self.budget = budget
        self.ejector = ejector
        self.factor = factor

    def decide(self, s: HedgeInput) -> HedgeDecision | None:
        """None: leave the worker's batches alone (for now)."""
        if not s.batches:
            return None
        running, *staged = s.batches
        if running.hedged or s.cost_line is None or not s.idempotent:
            return None
        expected = s.cost_line[0] + s.cost_line[1] * len(running.items)
        age = self.clock.now() - s.running_since
        if age < self.factor * expected or not self.ejector.is_slow(s.worker_id, age):
            return None
        if not s.others_ready:
            return None
        first = [i for i in owned(running) if _hedgeable(i, s.max_attempts)]
        later = [i for b in staged for i in owned(b) if _hedgeable(i, s.max_attempts)]
        if first and not self.budget.try_spend(len(first)):
            first = []
        return HedgeDecision(s.worker_id, age, expected, tuple(s.batches), tuple(first + later), len(first))


def _hedgeable(item: QueuedItem, max_attempts: int) -> bool:
    return (
        not item.hedged and item.crashes == 0 and item.isolation_round == 0 and item.attempts < max_attempts
    )
