"""One runtime's workers, kept the same way by every kind with workers: a worker joins (ready), drains
(no new work; it finishes what it holds, then exits and is replaced) or is lost (its connection broke or
its process exited), and fleet operations wait for the next arrival or departure.

The hub's handshake and read loop change it through the runtime's contract methods (`add_worker`,
`drain_worker`, `on_worker_lost`), and the runtime adds what its kind does then (batch: routing and the
recovery of lost batches, kinds/batch/membership.py; llm: moving a lost worker's streams; search:
assigning a replica its shard). Fleet control,
the admin API and the server read it through `worker_connections` and `membership_changed`.
"""

from __future__ import annotations

import asyncio

from inferd.clock import Clock
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState

LIVE = (WorkerState.READY, WorkerState.DRAINING)


class Membership:
    def __init__(self, clock: Clock, workers: list[WorkerConnection] | None = None) -> None:
        self.clock = clock
        self.workers: list[WorkerConnection] = [] if workers is None else workers
        """In join order; the kind's own loops read it (e.g. the batch dispatcher's state holds it)."""
        self._changed = asyncio.Event()

    def connections(self) -> tuple[WorkerConnection, ...]:
        """The ready and draining workers."""
        return tuple(w for w in self.workers if w.state in LIVE)

    def add(self, worker: WorkerConnection) -> None:
        """It joined and loaded its model: ready, and making progress from now."""
        worker.state = WorkerState.READY
        worker.last_progress = worker.last_heartbeat = self.clock.now()
        self.workers.append(worker)
        self.announce()

    def drain(self, worker: WorkerConnection) -> bool:
        """Tell a ready worker to drain; False when it was not ready (draining already, or gone)."""
        if worker.state is not WorkerState.READY:
            return False
        worker.state = WorkerState.DRAINING
        worker.send(p.Drain())
        return True

    def lose(self, worker: WorkerConnection) -> WorkerState:
        """It left (dead from now on); returns the state it was in."""
        if worker in self.workers:
            self.workers.remove(worker)
        was = worker.state
        worker.state = WorkerState.DEAD
        self.announce()
        return was

    async def changed(self) -> None:
        """Returns at the next worker arrival or departure."""
        await self._changed.wait()

    def announce(self) -> None:
        """Wake whoever waits on a change. Join and loss announce themselves; a kind may announce what
        else makes its workers useful or not (a search replica that starts serving its shard)."""
        self._changed.set()
        self._changed = asyncio.Event()
