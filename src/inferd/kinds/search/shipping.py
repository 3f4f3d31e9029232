"""The writer's side of a search index: assigning shards to replicas and shipping them the logs.

A joining replica is given a shard (kinds/search/runtime.py chooses which); the ShardAssign carries the
writer's lease epoch and, unless the replica holds the shard within the log's reach already, the snapshot
the writer keeps in its data_dir, as bytes over the worker connection, in pieces (snapshot.CHUNK_BYTES).
The log's entries after the replica's seq are then shipped in seq order, a few apply calls in flight.
Every `snapshot_every` entries the freshest replica of a shard is asked for its index, packed (read
piece by piece: `fetch_snapshot`); the writer stores it in its data_dir and drops the log before it.
Nothing is shipped while this front end does not write the index (kinds/search/writers.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Protocol

import msgspec

from inferd.errors import ServingError
from inferd.kinds.search import snapshot, wire
from inferd.kinds.search.config import SearchParams
from inferd.kinds.search.replicas import Replica, ReplicaPhase
from inferd.kinds.search.sequencer import ShardLog
from inferd.kinds.search.store import IndexStore
from inferd.kinds.search.writers import IndexWriter
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerState

log = logging.getLogger("inferd.search")

SHIP_ENTRIES = 64
"""Log entries per apply call."""
MAX_APPLIES_IN_FLIGHT = 4
SNAPSHOT_CALL_S = 120.0
"""The most one piece of a replica's snapshot may take (the first packs the index)."""


class Writing(Protocol):
    name: str
    params: SearchParams
    settings: Any
    store: IndexStore
    home: str
    """This front end's files in data_dir (IndexStore's `writer`)."""
    logs: list[ShardLog]
    writer: IndexWriter
    replicas: dict[Any, Replica]

    def call(self, replica: Replica, op: str, body: bytes) -> tuple[int, asyncio.Future[p.ShardReply]]: ...

    @staticmethod
    def forget(replica: Replica, call_id: int) -> None: ...

    @staticmethod
    def answer(reply: p.ShardReply) -> bytes: ...

    def shard_replicas(self, shard: int) -> list[Replica]: ...

    def drain_worker(self, worker: Any) -> None: ...

    def next_call_id(self) -> int: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...


class Shipper:
    def __init__(self, rt: Writing) -> None:
        self.rt = rt
        self.applying: dict[int, Replica] = {}
        """Apply calls in flight, by call id."""
        self.snapshot_seq = [lg.first_seq - 1 for lg in rt.logs]
        """The seq of each shard's snapshot in data_dir (as far as this front end knows)."""
        self.lineage = [(-1, 0)] * rt.params.shards
        """Per shard, the epoch of the writer whose entries this front end's log continues and the seq up
        to which (its takeover's source; -1: not known): a replica built under another writer reloads."""
        self._sent_snapshot: set[Replica] = set()
        """Replicas sent the snapshot's bytes since they last answered an assignment."""

    # ---- assignments -------------------------------------------------------------------------------
    def assign(self, replica: Replica, force_snapshot: bool = False) -> None:
        """Assign the replica its shard (`replica.shard`) under this front end's epoch: it keeps what it
        holds when that is within the log's reach, else loads the snapshot sent (read from data_dir
        first: the replica is not shipped entries meanwhile)."""
        shard_log = self.rt.logs[replica.shard]
        base = shard_log.first_seq - 1
        reload = force_snapshot or replica.applied_seq < 0  # (-1: what it holds is of no use)
        head = p.ShardAssign(
            replica.shard,
            wire.encode(self.rt.settings),
            self.rt.writer.epoch() or 0,
            base,
            shard_log.durable_seq,
            reload=reload,
            lineage=self.lineage[replica.shard][0],
            lineage_seq=self.lineage[replica.shard][1],
        )
        keeps = not reload and base <= replica.applied_seq <= shard_log.durable_seq
        if keeps or base == 0:
            if not keeps:
                replica.phase = ReplicaPhase.ASSIGNING
            replica.shipped_seq = replica.applied_seq if keeps else 0  # what it holds: the log follows
            replica.conn.send(head)  # at once: entries shipped after it reach the replica after it
            return
        replica.phase = ReplicaPhase.ASSIGNING
        self.rt.spawn(self._send_snapshot(replica, head))

    async def _send_snapshot(self, replica: Replica, head: p.ShardAssign) -> None:
        path = self.rt.store.snapshot_path(self.rt.name, head.shard, self.rt.home)
        try:
            packed = await asyncio.to_thread(snapshot.read_packed, path)
        except (ServingError, OSError) as exc:
            log.error("shard %d's snapshot in %s cannot be read: %s", head.shard, path, exc)
            packed = None
        self._sent_snapshot.add(replica)  # all there is: if it does not reach the log, it is drained
        if packed is None:
            replica.conn.send(head)
            return
        pieces = snapshot.chunks(packed[1])
        for i, piece in enumerate(pieces):
            replica.conn.send(msgspec.structs.replace(head, snapshot=piece, more=i < len(pieces) - 1))

    def assigned(self, replica: Replica, seq: int) -> bool:
        """The replica answered its assignment holding `seq`; False when it cannot serve from the log."""
        replica.applied_seq = replica.shipped_seq = seq
        sent = replica in self._sent_snapshot
        self._sent_snapshot.discard(replica)
        shard_log = self.rt.logs[replica.shard]
        if seq >= shard_log.first_seq - 1 and seq <= shard_log.durable_seq:
            replica.phase = ReplicaPhase.SERVING
            return True
        if not sent:  # it kept nothing that fits: send it the snapshot
            self.assign(replica, force_snapshot=True)
            return False
        log.error(
            "replica %s cannot catch up on shard %d: it holds seq %d after loading the snapshot sent, the "
            "log runs from %d to %d",
            replica.worker_id,
            replica.shard,
            seq,
            shard_log.first_seq,
            shard_log.durable_seq,
        )
        self.rt.drain_worker(replica.conn)
        return False

    # ---- the log -----------------------------------------------------------------------------------
    def applied(self, replica: Replica, call_id: int, msg: p.ShardReply) -> bool:
        """An apply's answer (False: the call was not one)."""
        if self.applying.pop(call_id, None) is None:
            return False
        if msg.error is not None:
            log.warning("replica %s apply failed: %s", replica.worker_id, msg.error[1])
            if msg.error[0] != "Conflict":  # a gap or a failed apply: ship again from what it holds
                replica.shipped_seq = msg.applied_seq  # (a Conflict: another writes it now: not again)
        return True

    def pump(self, replica: Replica) -> None:
        if not self.rt.writer.writes():  # only the writer ships the log
            return
        shard_log = self.rt.logs[replica.shard]
        while (
            replica.phase is ReplicaPhase.SERVING
            and replica.conn.state is not WorkerState.DEAD
            and replica.shipped_seq < shard_log.durable_seq
            and sum(1 for r in self.applying.values() if r is replica) < MAX_APPLIES_IN_FLIGHT
        ):
            entries = shard_log.entries_after(replica.shipped_seq, SHIP_ENTRIES)
            if entries is None:  # behind the in-memory log: reload the snapshot, then catch up
                log.info("replica %s reloads shard %d's snapshot", replica.worker_id, replica.shard)
                self.assign(replica, force_snapshot=True)
                return
            call_id = self.rt.next_call_id()
            self.applying[call_id] = replica
            replica.conn.send(p.ShardCall(call_id, "apply", wire.encode(list(entries))))
            replica.shipped_seq = entries[-1].seq

    def forget(self, replica: Replica) -> None:
        for call_id in [c for c, r in self.applying.items() if r is replica]:
            del self.applying[call_id]
        self._sent_snapshot.discard(replica)

    # ---- snapshots ---------------------------------------------------------------------------------
    async def snapshot_due(self) -> None:
        """Take the snapshots due (every `snapshot_every` entries of a shard's log)."""
        for shard in range(self.rt.params.shards):
            if not self.rt.writer.writes():
                return
            if self.rt.logs[shard].durable_seq - self.snapshot_seq[shard] >= self.rt.params.snapshot_every:
                await self._snapshot(shard)

    async def _snapshot(self, shard: int) -> None:
        serving = [r for r in self.rt.shard_replicas(shard) if r.readable]
        if not serving:
            return
        replica = max(serving, key=lambda r: r.applied_seq)
        try:
            seq = await self.keep(shard, await fetch_snapshot(self.rt, replica))
        except (ServingError, TimeoutError) as exc:
            log.warning("shard %d snapshot by %s failed: %s", shard, replica.worker_id, exc)
            return
        slowest = min((r.applied_seq for r in self.rt.shard_replicas(shard)), default=seq)
        await self.rt.logs[shard].snapshotted(seq, slowest)
        log.info("index %s shard %d: snapshot at seq %d by %s", self.rt.name, shard, seq, replica.worker_id)

    async def keep(self, shard: int, packed: bytes) -> int:
        """Store a packed snapshot of `shard` in this front end's data_dir; its seq."""
        seq, files, meta = snapshot.unpack(packed)
        path = self.rt.store.snapshot_path(self.rt.name, shard, self.rt.home)
        await asyncio.to_thread(snapshot.write, path, seq, files, meta)
        self.snapshot_seq[shard] = seq
        return seq


async def fetch_snapshot(rt: Writing, replica: Replica) -> bytes:
    """The replica's index, packed (snapshot.pack), read piece by piece over its connection."""
    pieces: list[bytes] = []
    offset, total = 0, None
    while total is None or offset < total:
        call_id, fut = rt.call(replica, "snapshot", wire.encode(offset))
        try:
            async with asyncio.timeout(SNAPSHOT_CALL_S):
                _, total, piece = wire.piece(rt.answer(await fut))
        finally:
            rt.forget(replica, call_id)
        if not piece and offset < total:
            raise TimeoutError(f"replica {replica.worker_id} sent an empty piece at {offset} of {total}")
        pieces.append(piece)
        offset += len(piece)
    return b"".join(pieces)
