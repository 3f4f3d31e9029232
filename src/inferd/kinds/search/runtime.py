"""The runtime contract's kind "search": one search index on the front end.

Its workers are shard replicas (kinds/search/replica.py). The index has one writer at a time: the front
end holding its lease `search-writer/<index>` (kinds/search/writers.py), once it has taken the shards
over (kinds/search/takeover.py). The writer numbers each shard's log entries (kinds/search/sequencer.py),
gives a joining replica the shard with the fewest replicas and ships it the snapshot and the log after
it (kinds/search/shipping.py); a replica serves reads once assigned. Every other front end (and the
writer's predecessor, once its grant lapsed) writes nothing: it learns each replica's shard and progress
from its notes (kinds/search/follower.py) and reads from the replicas the same way. The query and write
paths live in kinds/search/service.py; this module holds the replicas and their calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar

from inferd.cluster.config import cluster_config
from inferd.cluster.memory import MemoryStore
from inferd.cluster.store import Store, StoreError
from inferd.config import ModelConfig
from inferd.errors import ServingError, ShuttingDown, WorkerDied, WorkerUnavailable, from_wire
from inferd.kinds.search import wire
from inferd.kinds.search.config import params_of
from inferd.kinds.search.follower import KnownSeqs, Note, take_note
from inferd.kinds.search.replicas import Replica, ReplicaPhase, ReplicaSnapshot, least_served_shard
from inferd.kinds.search.sequencer import ShardLog
from inferd.kinds.search.service import IndexService, ServiceStatistics
from inferd.kinds.search.shipping import Shipper
from inferd.kinds.search.store import IndexStore
from inferd.kinds.search.takeover import take_over
from inferd.kinds.search.wire import ANNOUNCE
from inferd.kinds.search.writers import IndexWriter, keep_writer_lease
from inferd.runtime.contract import RuntimeStatistics, WorkerSnapshot
from inferd.runtime.kinds import RuntimeContext
from inferd.runtime.membership import Membership
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState

log = logging.getLogger("inferd.search")

WATCH_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class ShardStatistics:
    shard: int
    durable_seq: int
    applied_seq: int
    """The freshest serving replica's seq."""
    documents: int
    serving: int
    replicas: tuple[ReplicaSnapshot, ...]


@dataclass(frozen=True, slots=True)
class SearchStatistics:
    shards: tuple[ShardStatistics, ...]
    generation: int
    service: ServiceStatistics


class SearchRuntime:
    kind: ClassVar[str] = "search"
    accepts_workers: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, ctx: RuntimeContext, store: IndexStore) -> None:
        self.name = config.name
        self.config = config
        self.params = params_of(config)
        self.settings = self.params.settings()
        self.clock = ctx.clock
        self.kill_worker = ctx.kill_worker
        self.heartbeat_timeout_s = ctx.server.heartbeat_timeout_s
        self.store = store
        self.first_on_host = not ctx.follower
        """The first front end of its host (or the only one): its logs are data_dir's own files."""
        self.home = ""
        """Its files in data_dir (IndexStore's `writer`): "" for the first front end, else its id."""
        self.known = KnownSeqs(self.params.shards)
        """Each shard's last seq this front end knows of (kinds/search/follower.py)."""
        self.writer = IndexWriter(
            self.name, "0", self.clock, cluster_config(ctx.server).lease_ttl_s, contends=self.first_on_host
        )
        """Whether this front end writes the index now, and which does (kinds/search/writers.py)."""
        self.logs: list[ShardLog] = self._open_logs() if self.first_on_host else []
        self.shipper = Shipper(self)
        self.replicas: dict[WorkerConnection, Replica] = {}
        self.generation = 0
        """Bumped by every acknowledged write: result cache entries of older generations are stale."""
        self._ids = itertools.count(1)
        self._stopping: ServingError | None = None
        self._progress = asyncio.Event()
        self._shared_store = ctx.shared_store
        self.lease_store: Store = MemoryStore(self.clock)
        """Where the writer lease is: the store the front ends share (set when the runtime runs)."""
        self._takeover: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.members: Membership = ctx.directory.members(config.name, config.version)
        """Its replicas' connections (the server's WorkerDirectory's for this version,
        runtime/membership.py); `replicas` holds what each one serves."""
        self.index = IndexService(self, ctx)
        """The write and query paths (the API calls them)."""

    # ---- the contract ------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.config.version

    @property
    def follower(self) -> bool:
        """This front end does not write the index now (another does, or none: writes are refused)."""
        return not self.writer.writes()

    @property
    def ready(self) -> bool:
        return self._stopping is None and all(self.readable(s) for s in range(self.params.shards))

    def statistics(self) -> RuntimeStatistics:
        workers = tuple(
            WorkerSnapshot.of(r.conn, r.load, ReplicaSnapshot(*self._row(r))) for r in self.replicas.values()
        )
        return RuntimeStatistics(
            name=self.name,
            version=self.version,
            kind=self.kind,
            ready=self.ready,
            workers=workers,
            ready_workers=sum(1 for r in self.replicas.values() if r.readable),
            queued=0,
            in_flight=sum(r.load for r in self.replicas.values()),
            detail=SearchStatistics(
                tuple(self.shard_statistics(s) for s in range(self.params.shards)),
                self.generation,
                self.index.statistics(),
            ),
        )

    def shard_statistics(self, shard: int) -> ShardStatistics:
        mine = [r for r in self.replicas.values() if r.shard == shard]
        serving = [r for r in mine if r.readable]
        best = max(serving, key=lambda r: r.applied_seq, default=None)
        return ShardStatistics(
            shard,
            self.seq(shard),
            best.applied_seq if best else 0,
            best.documents if best else 0,
            len(serving),
            tuple(ReplicaSnapshot(*self._row(r)) for r in mine),
        )

    @staticmethod
    def _row(r: Replica) -> tuple[str, int, int, str, int, int, int]:
        return (r.worker_id, r.conn.pid, r.shard, r.phase.value, r.applied_seq, r.documents, r.load)

    async def run(self) -> None:
        try:
            shared = self._shared_store() if self._shared_store else (MemoryStore(self.clock), "0")
            self.lease_store, self.writer.me = shared
            self.home = "" if self.first_on_host else self.writer.me
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._watch())
                tg.create_task(keep_writer_lease(self.writer, self.lease_store, self._lead))
                tg.create_task(self._snapshots())
                tg.create_task(self.index.follow_embedder())
                if self.index.reembedder is not None:
                    tg.create_task(self.index.reembedder.run())
        finally:
            for task in [self._takeover, *self._tasks]:
                if task is not None:
                    task.cancel()
            refuse = self._stopping or ShuttingDown(f"index {self.name!r} is no longer served")
            for lg in self.logs:
                lg.close(refuse)

    def stop(self, exc: ServingError) -> None:
        self._stopping = exc
        for replica in self.replicas.values():
            self._fail(replica, exc)

    def add_worker(self, worker: WorkerConnection) -> None:
        """A replica joined: its first note (right after Ready) says the shard it holds, if any; the
        writer then assigns it one (that one, while the shard lacks replicas); another front end waits
        for the writer's choice (the replica's next notes)."""
        self.replicas[worker] = Replica(worker, -1)
        self.members.add(worker)
        self._notify()

    def on_message(self, worker: WorkerConnection, msg: p.Message) -> None:
        replica = self.replicas.get(worker)
        if replica is None or not isinstance(msg, p.ShardReply):
            return
        worker.last_progress = worker.last_heartbeat = self.clock.now()
        if msg.call_id == ANNOUNCE:
            note = Note(wire.number(msg.body), msg.applied_seq, msg.documents)
            if not self.writer.writes():
                self._noted(replica, note)
            elif replica.shard < 0:  # joined: assign it a shard
                self._choose_shard(replica, note.shard, note.applied_seq)
            return
        replica.applied_seq = max(replica.applied_seq, msg.applied_seq)
        replica.documents = msg.documents
        if msg.call_id == 0:
            if msg.error is not None:  # a newer writer assigned it: this one is deposed
                log.warning("replica %s refused an assignment: %s", replica.worker_id, msg.error[1])
            elif self.writer.writes() or self.writer.taking_over() is not None:
                self._assigned(replica, msg.applied_seq)
        elif not self.shipper.applied(replica, msg.call_id, msg):
            fut = replica.pending.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        worker.completed_batches += 1
        self.shipper.pump(replica)
        self._notify()

    def drain_worker(self, worker: WorkerConnection) -> None:
        if self.members.drain(worker):
            self._changed()

    def on_worker_lost(self, worker: WorkerConnection, reason: str) -> None:
        self.members.lose(worker)
        replica = self.replicas.pop(worker, None)
        if replica is None:
            return
        replica.phase = ReplicaPhase.GONE
        log.warning("replica %s of %s shard %d lost: %s", worker.worker_id, self.name, replica.shard, reason)
        self._fail(replica, WorkerDied(f"replica {worker.worker_id} of index {self.name!r} died: {reason}"))
        self._changed()

    def _choose_shard(self, replica: Replica, held: int, applied: int) -> None:
        """The shard the replica holds when that one lacks replicas (the writer restarted: it keeps its
        index), else the least served."""
        others = [r for r in self.replicas.values() if r is not replica]
        served = sum(1 for r in others if r.shard == held and r.phase is not ReplicaPhase.GONE)
        keep = 0 <= held < self.params.shards and served < self.params.replicas
        replica.shard = held if keep else least_served_shard(self.params.shards, others)
        replica.applied_seq = applied if keep else -1
        self.shipper.assign(replica)

    def _noted(self, replica: Replica, note: Note) -> None:
        """Not the writer: a replica's shard or progress (kinds/search/follower.py)."""
        if take_note(replica, note):
            self._fail(replica, WorkerDied(f"replica {replica.worker_id} moved to shard {note.shard}"))
        if self.known.learn(note.shard, note.applied_seq):
            self.index.results_changed()
        self._changed()

    # ---- the writer lease --------------------------------------------------------------------------------
    def _lead(self) -> None:
        """After each try for the writer lease: a grant not taken over yet starts its takeover; writes
        waiting for their acknowledgement look again (this front end may no longer write)."""
        self._notify()
        epoch = self.writer.taking_over()
        if epoch is not None and (self._takeover is None or self._takeover.done()):
            self._takeover = asyncio.create_task(self._take_over(epoch), name=f"search-takeover-{self.name}")

    async def _take_over(self, epoch: int) -> None:
        if not self.logs:
            self.logs = self._open_logs()
            self.shipper.snapshot_seq = [lg.first_seq - 1 for lg in self.logs]
        try:
            why = await take_over(self, epoch)
        except (ServingError, OSError) as exc:  # its log closed (the index goes), a disk that fails
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:  # another front end may: this one lets the lease go for a while
            log.warning("index %s: not taken over: %s", self.name, why)
            grant = self.writer.stand_down(self.writer.ttl_s)
            if grant is not None:
                with contextlib.suppress(StoreError, TimeoutError):
                    async with asyncio.timeout(self.writer.ttl_s):
                        await self.lease_store.release(grant)
            return
        for replica in list(self.replicas.values()):  # under the new epoch: from now on this one ships
            if replica.phase is ReplicaPhase.GONE:
                continue
            if 0 <= replica.shard < self.params.shards:
                self.shipper.assign(replica)
            else:
                self._choose_shard(replica, -1, 0)
        for shard, shard_log in enumerate(self.logs):
            self.known.learn(shard, shard_log.durable_seq)
        self.writer.took_over(epoch)
        for replica in self.replicas.values():
            self.shipper.pump(replica)
        self._changed()

    def _open_logs(self) -> list[ShardLog]:
        return [ShardLog(s, self.store.wal_path(self.name, s, self.home), self._refusal) for s in range(self.params.shards)]

    def _refusal(self, shard: int) -> ServingError | None:
        """Why a write to a shard's log is refused now: this front end does not write the index."""
        if self.writer.writes():
            return None
        other = self.writer.writer()
        who = f"front end {other} writes it" if other else "no front end writes it now (a takeover runs)"
        return WorkerUnavailable(
            f"index {self.name!r} is not written here: {who}; retry", self.writer.retry_after_s()
        )

    # ---- calls -------------------------------------------------------------------------------------------
    def seq(self, shard: int) -> int:
        """The shard's last seq: durable in the writer's log; another front end's, the last it heard of."""
        return self.logs[shard].durable_seq if self.writer.writes() else self.known.seqs[shard]

    def shard_replicas(self, shard: int) -> list[Replica]:
        return [r for r in self.replicas.values() if r.shard == shard]

    def readable(self, shard: int) -> bool:
        return any(r.readable for r in self.replicas.values() if r.shard == shard)

    def next_call_id(self) -> int:
        return next(self._ids)

    def call(self, replica: Replica, op: str, body: bytes) -> tuple[int, asyncio.Future[p.ShardReply]]:
        """Send one call; the future gets its reply (or WorkerDied). The caller `forget`s it after."""
        if self._stopping is not None:
            raise self._stopping
        call_id = next(self._ids)
        fut: asyncio.Future[p.ShardReply] = asyncio.get_running_loop().create_future()
        replica.pending[call_id] = fut
        replica.reads += 1
        replica.conn.send(p.ShardCall(call_id, op, body))
        return call_id, fut

    @staticmethod
    def forget(replica: Replica, call_id: int) -> None:
        replica.pending.pop(call_id, None)

    @staticmethod
    def answer(reply: p.ShardReply) -> bytes:
        """The reply's body, or its error raised as the ServingError it names."""
        if reply.error is not None:
            raise from_wire(*reply.error)
        return reply.body

    def appended(self, shard: int) -> None:
        """The shard's log grew: ship the new entries to its replicas."""
        self.known.learn(shard, self.logs[shard].durable_seq)
        for replica in self.shard_replicas(shard):
            self.shipper.pump(replica)

    async def wait_progress(self) -> None:
        """Until any replica's reply arrives (callers re-check what they wait for)."""
        await self._progress.wait()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` until done or the runtime stops."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _assigned(self, replica: Replica, seq: int) -> None:
        if self.shipper.assigned(replica, seq):
            self._changed()  # a serving replica: the index may be ready now

    # ---- background ----------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Kill replicas silent for the heartbeat timeout (the supervisor restarts them)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = self.clock.now()
            for replica in list(self.replicas.values()):
                conn = replica.conn
                if (
                    conn.state is not WorkerState.DEAD
                    and now - conn.last_heartbeat > self.heartbeat_timeout_s
                ):
                    conn.failure = "no heartbeat"
                    log.warning(
                        "replica %s silent for %.1fs: killing it", conn.worker_id, now - conn.last_heartbeat
                    )
                    self.kill_worker(conn)

    async def _snapshots(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            await self.shipper.snapshot_due()

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def _fail(self, replica: Replica, exc: ServingError) -> None:
        for fut in replica.pending.values():
            if not fut.done():
                fut.set_exception(exc)
        replica.pending.clear()
        self.shipper.forget(replica)

    def _notify(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    def _changed(self) -> None:
        self.members.announce()
        self._notify()
