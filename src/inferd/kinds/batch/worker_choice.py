"""The choice of worker for a batch: the zones that may take it (routing/locality.py, when the front end
and the workers have zones), the balancer (power of two choices) among their free workers, and the outlier
ejector, fed with each batch's outcome."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from inferd.routing import Candidate, EjectionRecord, Health, HealthChange, OutlierEjector, P2CBalancer
from inferd.routing.locality import NO_ZONE, Backlog, LocalityPolicy, LocalityStatistics
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState

log = logging.getLogger("inferd.dispatcher")


@dataclass(frozen=True, slots=True)
class Free:
    """The workers that may take the next batch now: idle ones and busy ones with a free staging slot."""

    idle: list[WorkerConnection] = field(default_factory=list)
    staging: list[WorkerConnection] = field(default_factory=list)
    spill_at: float | None = None
    """Another zone's worker is free and the zones with a share have none: when the waiting work may go
    there (load spill). None: not by time."""
    spill_at_queued: int | None = None
    """... or at how many items queued it may (None: not by queue length)."""


NONE_FREE = Free()


class Routing:
    """Which of a model's workers may take a batch, and which one does. Plain objects underneath (the
    zones' shares, the balancer and the ejector); this class feeds them and logs the ejector's decisions
    once."""

    def __init__(
        self,
        model: str,
        balancer: P2CBalancer,
        ejector: OutlierEjector,
        rng: random.Random,
        locality: LocalityPolicy | None = None,
    ) -> None:
        self.model = model
        self.balancer = balancer
        self.ejector = ejector
        self.rng = rng
        self.locality = locality
        """None, or a front end or workers without zones: every worker is one pool."""

    @property
    def zoned(self) -> bool:
        """Whether zones steer the work now (the front end and a worker have zones)."""
        locality = self.locality
        return locality is not None and locality.active

    def free_workers(self, workers: list[WorkerConnection], now: float, backlog: Backlog | None = None) -> Free:
        """Ready workers that may take a batch now: idle ones, and busy ones with a free staging slot.
        Ejected workers sit out (unless all are: then they work rather than stall the model); a probing
        worker takes one batch at a time; nobody goes over the balancer's per-worker cap. With zones, only
        the workers of the zone the next batch goes to (`_zone`: the waiting work, `backlog`, may spill to
        another zone once its zone is short of capacity)."""
        ready = [w for w in workers if w.state is WorkerState.READY]
        open_ = [w for w in ready if w.idle or w.stage_free]
        if not open_:
            return NONE_FREE  # the common case under load, and the cheap one: nobody has a free slot
        health_of = self.ejector.health
        health = {w.worker_id: health_of(w.worker_id) for w in open_}
        # only workers with a free slot can take a batch: the others' health matters only to know whether
        # every ready worker is ejected (then they all work), and that stops at the first one in service
        everyone_out = all(health_of(w.worker_id) is Health.EJECTED for w in ready)
        pool = open_ if everyone_out else [w for w in open_ if health[w.worker_id] is not Health.EJECTED]
        fits = [w for w in pool if self.balancer.eligible(self._candidate(w, health[w.worker_id]))]
        idle = [w for w in fits if w.idle]
        staging = [w for w in fits if w.stage_free and health[w.worker_id] is Health.READY]
        locality = self.locality
        if locality is None or not locality.active or not (idle or staging):
            return Free(idle, staging)
        return self._zone(locality, ready, idle, staging, backlog, now, everyone_out)

    def _zone(
        self,
        locality: LocalityPolicy,
        ready: list[WorkerConnection],
        idle: list[WorkerConnection],
        staging: list[WorkerConnection],
        backlog: Backlog | None,
        now: float,
        everyone_out: bool,
    ) -> Free:
        """The free workers of the zone the next batch goes to (locality.choose): the idle ones of a zone
        with a share; else, once that zone is short of capacity, another zone's idle ones (a load spill);
        else the staging slots of a zone with a share, and when the work may spill."""
        shares = locality.shares(*self._health(ready, everyone_out))
        if not shares.shares:  # no healthy worker anywhere: every free worker works, as without zones
            return Free(idle, staging)
        choice = locality.choose(shares, {w.zone or NO_ZONE for w in idle}, backlog)
        if choice.zone is not None:
            return Free([w for w in idle if (w.zone or NO_ZONE) == choice.zone])
        spill_at = None if choice.spill_in_s is None else now + choice.spill_in_s
        # no idle worker of a zone with a share: a staging slot there, until the work may spill
        zone = locality.choose(shares, {w.zone or NO_ZONE for w in staging}).zone
        return Free(
            [], [w for w in staging if zone is not None and (w.zone or NO_ZONE) == zone], spill_at, choice.spill_at_queued
        )

    def _health(
        self, ready: list[WorkerConnection], everyone_out: bool = False
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Per zone, the healthy workers (ready: connected, joined, not draining, not lost) and, of those,
        the ones in service (not ejected; all of them when every one is). The ejector's verdict is no
        zone health (routing/locality.py): it steers which workers take work, not the zones' shares."""
        healthy: dict[str, int] = {}
        serving: dict[str, int] = {}
        health_of = self.ejector.health
        for w in ready:
            zone = w.zone or NO_ZONE
            healthy[zone] = healthy.get(zone, 0) + 1
            if everyone_out or health_of(w.worker_id) in Health.ROUTABLE:  # probing: it must get its probe
                serving[zone] = serving.get(zone, 0) + 1
        return healthy, serving

    def wanted(self, workers: list[WorkerConnection], backlog: Backlog | None) -> list[WorkerConnection]:
        """The workers the waiting work may go to now, those to ask for slots (kinds/batch/credit_demand.py):
        with zones, those of the zones with a share, and every one once those zones are short of capacity
        (routing/locality.py); without, all. The shares are computed now: with no worker free (shared
        workers hold no slot until asked) no batch computed them since the zones' health last changed."""
        locality = self.locality
        if locality is None or not locality.active:
            return workers
        shares = locality.shares(*self._health_now(workers))
        if not shares.shares or locality.short(shares, backlog):
            return workers
        return [w for w in workers if shares.of(w.zone or NO_ZONE) > 0.0]

    def candidate(self, worker: WorkerConnection) -> Candidate:
        """A ready worker as the balancer sees it: suspect while probing (or ejected with the whole fleet)."""
        return self._candidate(worker, self.ejector.health(worker.worker_id))

    @staticmethod
    def _candidate(worker: WorkerConnection, health: Health) -> Candidate:
        in_service = health is Health.READY
        return Candidate(
            worker.worker_id, Health.READY if in_service else Health.PROBING, len(worker.inflight)
        )

    def choose(self, workers: list[WorkerConnection]) -> WorkerConnection:
        """Power of two choices among `workers` (all eligible, at least one)."""
        choice = self.balancer.choose([self.candidate(w) for w in workers], self.rng)
        if choice is None:
            raise RuntimeError(
                f"model '{self.model}': no eligible worker among {[w.worker_id for w in workers]}"
            )
        return next(w for w in workers if w.worker_id == choice.worker_id)

    def observe(self, worker_id: str, msg: p.BatchDone, held_s: float) -> None:
        """Feed the balancer and the ejector. Latency is how long the batch held the worker (from reaching
        the device, or the end of the batch before it, to the answer: IPC included), never less than the
        worker's own compute time. Failed batches feed no latency: failing fast must not attract traffic."""
        if msg.batch_error is not None:
            self.note(self.ejector.failure(worker_id))
            return
        latency_s = max(msg.compute_s, held_s)
        self.note(self.ejector.observe(worker_id, latency_s))
        self.balancer.observe(worker_id, latency_s)

    def overdue(self, worker_id: str, age_s: float) -> None:
        """The worker's running batch is far past its expected time (the watchdog hedged it)."""
        self.note(self.ejector.overdue(worker_id, age_s))

    def note(self, change: HealthChange | None) -> None:
        if change is None:
            return
        if change.health is Health.READY:
            self.balancer.forget(change.target)  # its slow history no longer describes it
        log.warning("model %s: %s", self.model, change)

    def sent(self, worker: WorkerConnection, items: int) -> None:
        """A batch of `items` went to the worker: counted against its zone's share."""
        if self.locality is not None and self.locality.active:
            self.locality.served(worker.zone or NO_ZONE, items)

    def join(self, worker: WorkerConnection) -> None:
        self.ejector.add(worker.worker_id)
        if self.locality is not None:
            self.locality.join(worker.worker_id, worker.zone)

    def leave(self, worker_id: str, lost: bool = False) -> None:
        """The worker takes no more work (draining, or `lost`): it leaves the fleet the ejector counts; a
        lost one's zone still expects it for a while (routing/locality.py)."""
        self.balancer.forget(worker_id)
        for change in self.ejector.remove(worker_id):
            self.note(change)
        if self.locality is not None:
            (self.locality.lose if lost else self.locality.leave)(worker_id)

    def zones(self, workers: list[WorkerConnection]) -> LocalityStatistics | None:
        """The zones' statistics, their shares computed now from `workers` (true at scrape time)."""
        if self.locality is None:
            return None
        return self.locality.statistics(*self._health_now(workers))

    def _health_now(self, workers: list[WorkerConnection]) -> tuple[dict[str, int], dict[str, int]]:
        """`_health` of the ready ones among `workers`."""
        ready = [w for w in workers if w.state is WorkerState.READY]
        everyone_out = all(self.ejector.health(w.worker_id) is Health.EJECTED for w in ready)
        return self._health(ready, everyone_out)

    def ejection(self, worker_id: str) -> EjectionRecord:
        return self.ejector.status(worker_id)
