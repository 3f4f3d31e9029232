"""Worker membership: workers join (ready), drain (no new work, finish what they hold) or are lost (their
connection broke); fleet operations wait for the next change.
"""

from __future__ import annotations

import asyncio
import logging

from inferd.kinds.batch.state import ModelState
from inferd.kinds.batch.worker_choice import Routing
from inferd.wire import protocol as p
from inferd.wire.connection import Batch, WorkerConnection, WorkerState

log = logging.getLogger("inferd.dispatcher")


class Membership:
    def __init__(self, state: ModelState, routing: Routing) -> None:
        self.state = state
        self.routing = routing
        self._changed = asyncio.Event()

    def connections(self) -> tuple[WorkerConnection, ...]:
        """The ready and draining connections."""
        live = (WorkerState.READY, WorkerState.DRAINING)
        return tuple(w for w in self.state.workers if w.state in live)

    def add(self, worker: WorkerConnection) -> None:
        worker.state = WorkerState.READY
        worker.last_progress = worker.last_heartbeat = self.state.clock.now()
        self.state.workers.append(worker)
        self.routing.join(worker.worker_id)
        log.info(
            "worker %s (pid %d) of model %s v%d is ready",
            worker.worker_id,
            worker.pid,
            self.state.name,
            worker.version,
        )
        self._announce()
        self.state.wake.set()

    def drain(self, worker: WorkerConnection) -> None:
        """No new batches; the worker finishes what it holds, then exits (and is replaced)."""
        if worker.state is not WorkerState.READY:
            return
        worker.state = WorkerState.DRAINING
        worker.send(p.Drain())
        self.routing.leave(worker.worker_id)
        log.info("draining worker %s (pid %d) of model %s", worker.worker_id, worker.pid, self.state.name)
        self.state.wake.set()

    def lose(self, worker: WorkerConnection, reason: str) -> list[Batch]:
        """The connection broke or the process exited: the worker leaves and is closed. Returns the
        batches it held (running first), now nobody's: the caller recovers them."""
        if worker in self.state.workers:
            self.state.workers.remove(worker)
        self.routing.leave(worker.worker_id)
        was = worker.state
        self._announce()
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

    async def changed(self) -> None:
        """Returns at the next worker arrival or departure (for fleet operations that wait on one)."""
        await self._changed.wait()

    def _announce(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
