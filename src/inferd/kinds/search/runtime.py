"""The runtime contract's kind "search": one search index on the front end.

Its workers are shard replicas (kinds/search/replica.py). A joining worker is given the shard with the fewest
replicas, loads that shard's snapshot and is shipped the log after it, in seq order, by the shard's one
writer (kinds/search/sequencer.py); it serves reads once assigned. Snapshots: every `snapshot_every` entries
one up-to-date replica of the shard writes one into data_dir, and the log before it is dropped. The
query and write paths live in kinds/search/service.py; this module holds the replicas and their calls.

With several front ends (`inferd serve --frontends N`) only the owner's runtime writes (the logs, the
shard assignment, the snapshots, the re-embeds); the others (followers) hold no log, learn each
replica's shard and progress from its notes (kinds/search/follower.py) and read from the replicas the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import ClassVar

from inferd.cluster.config import cluster_config
from inferd.cluster.memory import MemoryStore
from inferd.config import ModelConfig
from inferd.errors import ServingError, ShuttingDown, WorkerDied, from_wire
from inferd.kinds.search import wire
from inferd.kinds.search.config import params_of
from inferd.kinds.search.follower import KnownSeqs, Note, take_note
from inferd.kinds.search.replicas import Replica, ReplicaPhase, ReplicaSnapshot, least_served_shard
from inferd.kinds.search.sequencer import ShardLog
from inferd.kinds.search.service import IndexService, ServiceStatistics
from inferd.kinds.search.store import IndexStore
from inferd.kinds.search.wire import ANNOUNCE
from inferd.kinds.search.writers import IndexWriter, keep_writer_lease
from inferd.runtime.contract import RuntimeStatistics, WorkerSnapshot
from inferd.runtime.kinds import RuntimeContext
from inferd.runtime.membership import Membership
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState

log = logging.getLogger("inferd.search")

SHIP_ENTRIES = 64
"""Log entries per apply call."""
MAX_APPLIES_IN_FLIGHT = 4
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
        self.follower = ctx.follower
        """One of several front ends, not the owner: it writes nothing (the owner holds the logs)."""
        self.known = KnownSeqs(self.params.shards)
        """A follower's view of the shards' logs (kinds/search/follower.py)."""
        shards = () if self.follower else range(self.params.shards)
        self.logs = [ShardLog(s, store.wal_path(self.name, s)) for s in shards]
        self.snapshot_seq = [lg.first_seq - 1 for lg in self.logs]
        self.replicas: dict[WorkerConnection, Replica] = {}
        self.generation = 0
        """Bumped by every acknowledged write: result cache entries of older generations are stale."""
        self._ids = itertools.count(1)
        self._applying: dict[int, Replica] = {}
        self._stopping: ServingError | None = None
        self._progress = asyncio.Event()
        self.members: Membership = ctx.directory.members(config.name, config.version)
        """Its replicas' connections (the server's WorkerDirectory's for this version,
        runtime/membership.py); `replicas` holds what each one serves."""
        self.index = IndexService(self, ctx)
        """The write and query paths (the API calls them)."""
        self.writer = IndexWriter(
            self.name, "0", self.clock, cluster_config(ctx.server).lease_ttl_s, contends=not self.follower
        )
        """Whether this front end writes the index now, and which does (kinds/search/writers.py)."""
        self._shared_store = ctx.shared_store
        self._takeover: asyncio.Task[None] | None = None

    # ---- the contract ------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.config.version

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
            store, self.writer.me = self._shared_store() if self._shared_store else (MemoryStore(self.clock), "0")
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._watch())
                tg.create_task(keep_writer_lease(self.writer, store, self._lead))
                if self.follower:
                    tg.create_task(self.index.follow_embedder())
                else:
                    tg.create_task(self._snapshots())
                if self.index.reembedder is not None:
                    tg.create_task(self.index.reembedder.run())
        finally:
            if self._takeover is not None:
                self._takeover.cancel()
            refuse = self._stopping or ShuttingDown(f"index {self.name!r} is no longer served")
            for lg in self.logs:
                lg.close(refuse)

    def stop(self, exc: ServingError) -> None:
        self._stopping = exc
        for replica in self.replicas.values():
            self._fail(replica, exc)

    def add_worker(self, worker: WorkerConnection) -> None:
        """A replica joined: its first note (right after Ready) says the shard it holds, if any; the
        writer then assigns it one (that one, while the shard lacks replicas); a follower waits for the
        writer's choice (the replica's next notes)."""
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
            if self.follower:
                self._noted(replica, note)
            elif replica.shard < 0:  # joined: assign it a shard
                self._choose_shard(replica, note.shard)
            return
        replica.applied_seq = max(replica.applied_seq, msg.applied_seq)
        replica.documents = msg.documents
        if msg.call_id == 0:
            self._assigned(replica, msg.applied_seq)
        elif self._applying.pop(msg.call_id, None) is not None:
            if msg.error is not None:  # a gap or a failed apply: ship again from what it holds
                log.warning("replica %s apply failed: %s", replica.worker_id, msg.error[1])
                replica.shipped_seq = msg.applied_seq
        else:
            fut = replica.pending.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        worker.completed_batches += 1
        self._pump(replica)
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

    def _choose_shard(self, replica: Replica, held: int) -> None:
        """The shard the replica holds when that one lacks replicas (the writer restarted: it keeps its
        index), else the least served."""
        others = [r for r in self.replicas.values() if r is not replica]
        served = sum(1 for r in others if r.shard == held and r.phase is not ReplicaPhase.GONE)
        keep = 0 <= held < self.params.shards and served < self.params.replicas
        replica.shard = held if keep else least_served_shard(self.params.shards, others)
        self._assign(replica)

    def _noted(self, replica: Replica, note: Note) -> None:
        """A follower: a replica's shard or progress (kinds/search/follower.py)."""
        if take_note(replica, note):
            self._fail(replica, WorkerDied(f"replica {replica.worker_id} moved to shard {note.shard}"))
        if self.known.learn(note.shard, note.applied_seq):
            self.index.results_changed()
        self._changed()

    def _lead(self) -> None:
        """After each try for the writer lease: a grant not taken over yet starts its takeover."""
        epoch = self.writer.taking_over()
        if epoch is not None and (self._takeover is None or self._takeover.done()):
            self._takeover = asyncio.create_task(self._take_over(epoch), name=f"search-takeover-{self.name}")

    async def _take_over(self, epoch: int) -> None:
        """This front end's own logs are the index's (the one writer of its host)."""
        self.writer.took_over(epoch)

    # ---- calls -------------------------------------------------------------------------------------------
    def seq(self, shard: int) -> int:
        """The shard's last seq: durable in the owner's log; a follower's, the last it heard of."""
        return self.known.seqs[shard] if self.follower else self.logs[shard].durable_seq

    def shard_replicas(self, shard: int) -> list[Replica]:
        return [r for r in self.replicas.values() if r.shard == shard]

    def readable(self, shard: int) -> bool:
        return any(r.readable for r in self.replicas.values() if r.shard == shard)

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
        for replica in self.shard_replicas(shard):
            self._pump(replica)

    async def wait_progress(self) -> None:
        """Until any replica's reply arrives (callers re-check what they wait for)."""
        await self._progress.wait()

    # ---- shipping ----------------------------------------------------------------------------------------
    def _assign(self, replica: Replica) -> None:
        replica.phase = ReplicaPhase.ASSIGNING
        replica.conn.send(
            p.ShardAssign(
                replica.shard,
                wire.encode(self.settings),
                str(self.store.snapshot_path(self.name, replica.shard)),
            )
        )

    def _assigned(self, replica: Replica, seq: int) -> None:
        replica.applied_seq = replica.shipped_seq = seq
        if seq < self.logs[replica.shard].first_seq - 1:  # its snapshot is older than the log we hold
            log.error(
                "replica %s cannot catch up on shard %d: it holds seq %d, the log starts at %d; a replica "
                "needs the index's snapshots in data_dir (a shared folder for replicas on other hosts)",
                replica.worker_id,
                replica.shard,
                seq,
                self.logs[replica.shard].first_seq,
            )
            self.drain_worker(replica.conn)
            return
        replica.phase = ReplicaPhase.SERVING
        self._changed()  # a serving replica: the index may be ready now

    def _pump(self, replica: Replica) -> None:
        if self.follower:  # the owner ships the log
            return
        shard_log = self.logs[replica.shard]
        while (
            replica.phase is ReplicaPhase.SERVING
            and replica.conn.state is not WorkerState.DEAD
            and replica.shipped_seq < shard_log.durable_seq
            and sum(1 for r in self._applying.values() if r is replica) < MAX_APPLIES_IN_FLIGHT
        ):
            entries = shard_log.entries_after(replica.shipped_seq, SHIP_ENTRIES)
            if entries is None:  # behind the in-memory log: reload the snapshot, then catch up
                log.info("replica %s reloads shard %d's snapshot", replica.worker_id, replica.shard)
                self._assign(replica)
                return
            call_id = next(self._ids)
            self._applying[call_id] = replica
            replica.conn.send(p.ShardCall(call_id, "apply", wire.encode(list(entries))))
            replica.shipped_seq = entries[-1].seq

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
            for shard in range(self.params.shards):
                if self.logs[shard].durable_seq - self.snapshot_seq[shard] >= self.params.snapshot_every:
                    await self._snapshot(shard)

    async def _snapshot(self, shard: int) -> None:
        serving = [r for r in self.shard_replicas(shard) if r.readable]
        if not serving:
            return
        replica = max(serving, key=lambda r: r.applied_seq)
        call_id, fut = self.call(replica, "snapshot", b"")
        try:
            seq = wire.number(self.answer(await fut))
        except ServingError as exc:
            log.warning("shard %d snapshot by %s failed: %s", shard, replica.worker_id, exc.message)
            return
        finally:
            self.forget(replica, call_id)
        slowest = min((r.applied_seq for r in self.shard_replicas(shard)), default=seq)
        await self.logs[shard].snapshotted(seq, slowest)
        self.snapshot_seq[shard] = seq
        log.info("index %s shard %d: snapshot at seq %d by %s", self.name, shard, seq, replica.worker_id)

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def _fail(self, replica: Replica, exc: ServingError) -> None:
        for fut in replica.pending.values():
            if not fut.done():
                fut.set_exception(exc)
        replica.pending.clear()
        for call_id in [c for c, r in self._applying.items() if r is replica]:
            del self._applying[call_id]

    def _notify(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    def _changed(self) -> None:
        self.members.announce()
        self._notify()
