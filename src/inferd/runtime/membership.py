"""Worker membership, owned once for the whole server: the `WorkerDirectory` holds every served model
version's workers (one `Membership` each, keyed by (model, version)) and the connections still in their
handshake.

The composition root (server.py) creates the directory once. Each runtime with workers takes its
version's `Membership` from it when it is built (`RuntimeContext.directory`); a runtime that refuses
workers (upstream) takes none, and so has none. The hub writes it: a connection joins it in its
handshake (`handshake`), becomes its runtime's worker (`add_worker` -> `Membership.add`), drains
(`Membership.drain`) or is lost (`Membership.lose`), and the runtime adds what its kind does then (batch:
routing and the recovery of lost batches, kinds/batch/membership.py; llm: moving a lost worker's streams;
search: assigning a replica its shard). Fleet control, the admin API and the server read it
(`workers(model, version)`, `await changed(model, version)`, `find(worker_id)`); `remove_version` drops
a version's membership.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from inferd.clock import Clock
from inferd.errors import NotFound
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState

LIVE = (WorkerState.READY, WorkerState.DRAINING)


class Membership:
    """One model version's workers: a worker joins (ready), drains (no new work; it finishes what it
    holds, then exits and is replaced) or is lost (its connection broke or its process exited)."""

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

    def drain(self, worker: WorkerConnection, retired: bool = False) -> bool:
        """Tell a ready worker to drain (`retired`: because its version is no longer served); False when
        it was not ready (draining already, or gone)."""
        if worker.state is not WorkerState.READY:
            return False
        worker.state = WorkerState.DRAINING
        worker.send(p.Drain(retired=retired))
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


class WorkerDirectory:
    """The server's workers: each served model version's `Membership`, and the handshakes under way."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._members: dict[tuple[str, int], Membership] = {}
        self._retired: list[Membership] = []
        """Dropped versions' memberships while workers of theirs are still connected (closed at
        shutdown with the others); each leaves once its last worker is lost."""
        self._joining: set[WorkerConnection] = set()

    # ---- the runtimes take their membership; the server drops it ---------------------------------------
    def members(self, model: str, version: int) -> Membership:
        """The version's membership (made on first use): its runtime takes it when it is built."""
        key = (model, version)
        members = self._members.get(key)
        if members is None:
            members = self._members[key] = Membership(self.clock)
        return members

    def drop(self, model: str, version: int) -> None:
        """The version is no longer served (`remove_version`, the old version of a rolling update): its
        membership leaves, and whoever waits on it wakes. A runtime of the same version served again
        starts with a membership of its own. Its workers still ready (workers on other hosts, which no
        rolling update drains) are told to drain, as retired: one that serves the default version joins
        again at the new default (`Drain.retired`), one pinned to this version exits."""
        members = self._members.pop((model, version), None)
        if members is None:
            return
        for worker in list(members.workers):
            members.drain(worker, retired=True)
        if members.workers:
            self._retired.append(members)
        members.announce()

    # ---- the hub writes ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def handshake(self, conn: WorkerConnection) -> Iterator[None]:
        """The connection is in its handshake until the block exits: then it is its runtime's worker (the
        runtime added it), or it failed (refused, could not load, timed out, broke) and is gone."""
        self._joining.add(conn)
        try:
            yield
        finally:
            self._joining.discard(conn)

    def handshaking(self) -> int:
        """Connections in their handshake now."""
        return len(self._joining)

    def connections(self) -> list[WorkerConnection]:
        """Every connection the hub holds: handshakes, the served versions' workers and those of
        dropped versions not yet gone (the hub closes them all at shutdown)."""
        self._retired = [m for m in self._retired if m.workers]
        memberships = [*self._members.values(), *self._retired]
        return [*self._joining, *(w for m in memberships for w in m.workers)]

    # ---- fleet control, the admin API and the server read --------------------------------------------
    def workers(self, model: str, version: int) -> tuple[WorkerConnection, ...]:
        """The version's ready and draining workers (none: not served, or a kind without workers)."""
        members = self._members.get((model, version))
        return () if members is None else members.connections()

    async def changed(self, model: str, version: int) -> None:
        """Returns at the version's next worker arrival or departure, or when it is dropped."""
        members = self._members.get((model, version))
        if members is None:
            raise NotFound(f"model {model!r} version {version} has no workers here: it is not served")
        await members.changed()

    def find(self, worker_id: str) -> tuple[str, int, WorkerConnection]:
        """The (model, version) a ready or draining worker serves, and its connection."""
        for (model, version), members in self._members.items():
            for w in members.connections():
                if w.worker_id == worker_id:
                    return model, version, w
        raise NotFound(f"no connected worker {worker_id!r}")
