"""A batch model's load on one front end, and the whole server's load with several front ends: what a
kind that queues in each front end (`Kind.queues_per_frontend`) measures, and what its autoscaling
observer (kinds/batch/demand.py) is handed, below the kinds and fleet/.

Each front end of `inferd serve --frontends N` queues, batches and measures only the requests that reach
it: its queue depth, its arrival rate and its share of the devices' busy time (the workers are shared:
each front end's busy ratio counts only its own batches). The owner's autoscaler must decide on the
whole server's load, so the other front ends (followers) report their `ModelLoad`s to the owner every
second (cluster/load.py: each writes its `load/<frontend>` document in the cluster store, and the
front end that decides reads them) and it adds the fresh ones to its own (`FrontendLoads.total`).
A report older than `expire_after_s` no longer counts: a follower that died stops counting within a
few intervals, one that restarts counts again from its next report. Plain objects, injected clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inferd.clock import Clock
from inferd.runtime.contract import RuntimeStatistics

REPORT_INTERVAL_S = 1.0
"""How often a follower reports its load to the owner (the autoscaler's own interval)."""
EXPIRE_AFTER_S = 3 * REPORT_INTERVAL_S
"""A follower's report counts this long: after three missed intervals it is gone."""


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One version of a batch model on one front end (or, summed, on the whole server)."""

    model: str
    version: int
    queued_items: int = 0
    arrival_rate_items_s: float = 0.0
    busy_ratio: float = 0.0
    """The share of the last busy window the devices spent on this front end's batches, 0..1."""

    def plus(self, other: ModelLoad) -> ModelLoad:
        """Both loads together; the busy ratio is the devices' (their shares add up to at most 1)."""
        return ModelLoad(
            self.model,
            self.version,
            self.queued_items + other.queued_items,
            self.arrival_rate_items_s + other.arrival_rate_items_s,
            min(1.0, self.busy_ratio + other.busy_ratio),
        )


class ArrivalMeter:
    """Items admitted per second since the last look, from a runtime's running count of admitted items.
    A new version restarts the count: its first look measures nothing (rate 0)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._last: tuple[int, int] | None = None
        """(version, items admitted) at the last look."""
        self._at = clock.now()

    def rate(self, version: int, enqueued_total: int) -> float:
        now = self.clock.now()
        elapsed = max(1e-3, now - self._at)
        previous = self._last
        rate = 0.0
        if previous is not None and previous[0] == version:
            rate = (enqueued_total - previous[1]) / elapsed
        self._last, self._at = (version, enqueued_total), now
        return max(0.0, rate)


def model_load(stats: RuntimeStatistics, arrival_rate_items_s: float) -> ModelLoad:
    """A batch runtime's snapshot as its front end's load."""
    return ModelLoad(
        stats.name,
        stats.version,
        stats.queued,
        arrival_rate_items_s,
        min(1.0, max(0.0, stats.detail.busy_ratio)),
    )


class FrontendLoads:
    """The owner's view of the other front ends' loads: each one's latest report, while fresh."""

    def __init__(self, clock: Clock, expire_after_s: float = EXPIRE_AFTER_S) -> None:
        self.clock = clock
        self.expire_after_s = expire_after_s
        self._reports: dict[int | str, tuple[float, tuple[ModelLoad, ...]]] = {}
        """Front end (its index on one host, else its id) -> (when its latest report came, its loads)."""

    def record(self, frontend: int | str, loads: Iterable[ModelLoad]) -> None:
        """Front end `frontend` reported: its loads replace what it reported before."""
        self._reports[frontend] = (self.clock.now(), tuple(loads))

    def reporting(self) -> list[int | str]:
        """The front ends whose latest report still counts (stale ones are forgotten)."""
        now = self.clock.now()
        for index, (at, _) in list(self._reports.items()):
            if now - at > self.expire_after_s:
                del self._reports[index]
        return sorted(self._reports, key=str)

    def total(self, own: ModelLoad) -> ModelLoad:
        """`own` (the owner's load) plus every fresh report of the same model and version."""
        whole = own
        for index in self.reporting():
            for load in self._reports[index][1]:
                if load.model == own.model and load.version == own.version:
                    whole = whole.plus(load)
        return whole
