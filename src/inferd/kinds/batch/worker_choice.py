"""The choice of worker for a batch: the balancer (power of two choices) and the outlier ejector, fed
with each batch's outcome."""

from __future__ import annotations

import logging
import random

from inferd.routing import Candidate, EjectionRecord, Health, HealthChange, OutlierEjector, P2CBalancer
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState

log = logging.getLogger("inferd.dispatcher")


class Routing:
    """Which of a model's workers may take a batch, and which one does. Plain objects underneath (the
    balancer and the ejector); this class feeds them and logs the ejector's decisions once."""

    def __init__(
        self, model: str, balancer: P2CBalancer, ejector: OutlierEjector, rng: random.Random
    ) -> None:
        self.model = model
        self.balancer = balancer
        self.ejector = ejector
        self.rng = rng

    def free_workers(
        self, workers: list[WorkerConnection]
    ) -> tuple[list[WorkerConnection], list[WorkerConnection]]:
        """Ready workers that may take a batch now: idle ones, and busy ones with a free staging slot.
        Ejected workers sit out (unless all are: then they work rather than stall the model); a probing
        worker takes one batch at a time; nobody goes over the balancer's per-worker cap."""
        ready = [w for w in workers if w.state is WorkerState.READY]
        open_ = [w for w in ready if w.idle or w.stage_free]
        if not open_:
            return [], []  # the common case under load, and the cheap one: nobody has a free slot
        health_of = self.ejector.health
        health = {w.worker_id: health_of(w.worker_id) for w in open_}
        # only workers with a free slot can take a batch: the others' health matters only to know whether
        # every ready worker is ejected (then they all work), and that stops at the first one in service
        everyone_out = all(health_of(w.worker_id) is Health.EJECTED for w in ready)
        pool = open_ if everyone_out else [w for w in open_ if health[w.worker_id] is not Health.EJECTED]
        fits = [w for w in pool if self.balancer.eligible(self._candidate(w, health[w.worker_id]))]
        idle = [w for w in fits if w.idle]
        staging = [w for w in fits if w.stage_free and health[w.worker_id] is Health.READY]
        return idle, staging

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

    def join(self, worker_id: str) -> None:
        self.ejector.add(worker_id)

    def leave(self, worker_id: str) -> None:
        """The worker takes no more work (draining or lost): it leaves the fleet the ejector counts."""
        self.balancer.forget(worker_id)
        for change in self.ejector.remove(worker_id):
            self.note(change)

    def ejection(self, worker_id: str) -> EjectionRecord:
        return self.ejector.status(worker_id)
