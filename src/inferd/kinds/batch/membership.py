"""What the batch kind does when its workers change, around its version's `Membership` (taken from the
server's WorkerDirectory, runtime/membership.py: join, drain, loss, the change event): a worker that
joins enters routing and wakes the dispatcher; one that drains leaves routing; one that is lost leaves
routing, is closed, and hands back the batches it held for recovery.
"""

from __future__ import annotations

import logging

from inferd.kinds.batch.state import ModelState
from inferd.kinds.batch.worker_choice import Routing
from inferd.runtime.membership import Membership
from inferd.wire.connection import Batch, WorkerConnection, WorkerState

log = logging.getLogger("inferd.dispatcher")


class BatchMembership:
    def __init__(self, state: ModelState, routing: Routing, members: Membership) -> None:
        self.state = state
        self.routing = routing
        self.members = members
        """The model version's, from the server's WorkerDirectory; its `workers` are `state.workers`."""

    def add(self, worker: WorkerConnection) -> None:
        self.members.add(worker)
        self.routing.join(worker)
        log.info(
            "worker %s (pid %d) of model %s v%d is ready",
            worker.worker_id,
            worker.pid,
            self.state.name,
            worker.version,
        )
        self.state.wake.set()

    def drain(self, worker: WorkerConnection) -> None:
        """No new batches; the worker finishes what it holds, then exits (and is replaced)."""
        if not self.members.drain(worker):
            return
        self.routing.leave(worker.worker_id)
        log.info("draining worker %s (pid %d) of model %s", worker.worker_id, worker.pid, self.state.name)
        self.state.wake.set()

    def lose(self, worker: WorkerConnection, reason: str) -> list[Batch]:
        """The connection broke or the process exited: the worker leaves and is closed. Returns the
        batches it held (running first), now nobody's: the caller recovers them."""
        was = self.members.lose(worker)
        self.routing.leave(worker.worker_id, lost=was is WorkerState.READY)
        worker.close()
        batches = list(worker.inflight.values())
        worker.inflight.clear()
        if was is WorkerState.DRAINING and not batches:
            log.info(
                "worker %s (pid %d) of model %s drained and left",
                worker.worker_id,
                worker.pid,
                self.state.name,
            )
        elif was is not WorkerState.DEAD:
            log.warning(
                "worker %s (pid %d) of model %s lost: %s; %d batch(es) in flight",
                worker.worker_id,
                worker.pid,
                self.state.name,
                worker.failure or reason,
                len(batches),
            )
        return batches
