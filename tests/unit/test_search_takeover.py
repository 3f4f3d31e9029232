"""A search index's writer changing hands: the rule that picks each shard's source (kinds/search/takeover.py),
a replica's fence and snapshot pieces (kinds/search/handover.py), snapshots over the wire, and a new
writer's log based on what it took over (wal.py, sequencer.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from inferd.errors import BadRequest, WorkerUnavailable
from inferd.kinds.search import snapshot, wire
from inferd.kinds.search.config import SearchParams
from inferd.kinds.search.handover import IncomingSnapshot, OutgoingSnapshot, WriterFence, keeps
from inferd.kinds.search.sequencer import ShardLog
from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.store import IndexStore
from inferd.kinds.search.takeover import Heard, Source, choose
from inferd.kinds.search.types import CorruptSnapshot, Document, LogEntry, Upsert
from inferd.kinds.search.wal import WriteAheadLog
from inferd.wire import protocol as p


def heard(name: str, shard: int, seq: int, epoch: int = 1) -> Heard:
    return Heard(SimpleNamespace(worker_id=name), shard, seq, epoch)  # type: ignore[arg-type]


# ---- the rule -------------------------------------------------------------------------------------------
def test_the_highest_replica_is_the_shards_state() -> None:
    answers = [heard("a", 0, 5), heard("b", 0, 8), heard("c", 1, 9), heard("d", 0, 7)]
    source = choose(0, answers, own_seq=3, own_epoch=1, known_seq=8)
    assert isinstance(source, Source)
    assert (source.replica.worker_id, source.seq) == ("b", 8)  # type: ignore[union-attr]


def test_its_own_log_when_it_is_as_far_as_every_replica_and_as_new() -> None:
    answers = [heard("a", 0, 5), heard("b", 0, 8)]
    assert choose(0, answers, own_seq=8, own_epoch=1, known_seq=8) == Source(0, None, 8)
    assert choose(0, [], own_seq=4, own_epoch=0, known_seq=4) == Source(0, None, 4)  # a whole server restarted
    assert choose(0, [heard("a", 0, 0, epoch=0)], own_seq=12, own_epoch=3, known_seq=0) == Source(0, None, 12)


def test_an_own_log_older_than_the_replicas_writer_is_not_trusted_even_when_longer() -> None:
    # this front end wrote seq 6 under epoch 1 that no replica applied; epoch 2's writer wrote its own 6
    answers = [heard("a", 0, 6, epoch=2)]
    source = choose(0, answers, own_seq=6, own_epoch=1, known_seq=6)
    assert isinstance(source, Source) and source.replica is not None and source.seq == 6


def test_a_shard_it_cannot_source_refuses_the_takeover() -> None:
    why = choose(1, [heard("a", 0, 8)], own_seq=2, own_epoch=1, known_seq=5)
    assert isinstance(why, str) and "shard 1" in why and "seq 5" in why


def test_a_replica_of_an_older_writer_is_not_the_state_even_when_further() -> None:
    # r_old applied the old writer's 6 and 7 (never acknowledged); the newer writer took over at 5 and
    # wrote its own 6, which r_new applied and which may have been acknowledged
    answers = [heard("r_old", 0, 7, epoch=1), heard("r_new", 0, 6, epoch=2)]
    source = choose(0, answers, own_seq=0, own_epoch=0, known_seq=7)
    assert isinstance(source, Source) and source.replica.worker_id == "r_new" and source.seq == 6  # type: ignore[union-attr]


def test_after_a_whole_restart_only_the_last_writers_own_log_counts() -> None:
    empty = [heard("a", 0, 0, epoch=0)]  # its replicas started again: empty
    assert choose(0, empty, own_seq=9, own_epoch=4, known_seq=0, last_epoch=4) == Source(0, None, 9)
    stale = choose(0, empty, own_seq=12, own_epoch=3, known_seq=0, last_epoch=4)
    assert isinstance(stale, str) and "epoch 4" in stale  # a longer log, but not the last writer's
    assert isinstance(choose(0, [], own_seq=0, own_epoch=0, known_seq=0, last_epoch=4), str)
    newest = choose(0, [heard("b", 0, 3, epoch=4)], own_seq=12, own_epoch=3, known_seq=0, last_epoch=4)
    assert isinstance(newest, Source) and newest.replica is not None and newest.seq == 3


# ---- a replica's fence ------------------------------------------------------------------------------------
def test_a_replica_follows_the_newest_writer_and_refuses_a_deposed_one() -> None:
    fence = WriterFence()
    assert fence.admit(0, 1) is None and fence.writes(0)
    assert fence.admit(1, 2) is None and fence.writes(1) and not fence.writes(0)
    refused = fence.admit(0, 1)  # the old writer resumed
    assert refused is not None and "epoch 2" in refused
    assert fence.writes(1) and fence.epoch == 2
    assert fence.admit(0, 2) is None  # the same epoch from a new link: the writer's front end restarted
    fence.left(0)
    assert fence.link is None and not fence.writes(0)


def test_a_replica_keeps_its_index_only_within_the_writers_log() -> None:
    held = (0, b"settings", 8, 1)
    assign = p.ShardAssign(0, b"settings", epoch=2, base_seq=5, last_seq=9)
    assert keeps(held, assign)
    assert not keeps((0, b"settings", 4, 1), assign)  # behind the log: the snapshot
    assert not keeps((0, b"settings", 10, 1), assign)  # a former writer's entries past the new log's end
    assert not keeps((1, b"settings", 8, 1), assign) and not keeps((0, b"other", 8, 1), assign)
    assert not keeps(None, assign)
    continues = p.ShardAssign(0, b"settings", epoch=3, base_seq=5, last_seq=9, lineage=2, lineage_seq=8)
    assert keeps((0, b"settings", 8, 2), continues)  # built under the writer whose log it continues
    assert keeps((0, b"settings", 9, 3), continues)  # or under this one
    assert not keeps((0, b"settings", 8, 1), continues)  # another writer's seq 6..8 may differ
    assert not keeps((0, b"settings", 9, 2), continues)  # that writer's seq 9 was not taken over
    assert keeps(held, p.ShardAssign(0, b"settings"))  # no bounds said: a writer that came back
    reload = p.ShardAssign(0, b"settings", epoch=2, base_seq=5, last_seq=9, reload=True)
    assert not keeps(held, reload)  # it follows an older writer: its entries may differ from the new one's


def test_snapshot_pieces_are_joined_per_link() -> None:
    incoming = IncomingSnapshot()
    assert incoming.add(0, p.ShardAssign(0, b"s", snapshot=b"ab", more=True)) is None
    assert incoming.add(1, p.ShardAssign(0, b"s", snapshot=b"XY", more=True)) is None
    whole = incoming.add(0, p.ShardAssign(0, b"s", epoch=3, snapshot=b"cd"))
    assert whole is not None and (whole.snapshot, whole.more, whole.epoch) == (b"abcd", False, 3)
    incoming.left(1)
    again = incoming.add(1, p.ShardAssign(0, b"s", snapshot=b"z"))
    assert again is not None and again.snapshot == b"z"


def test_a_packed_index_is_read_piece_by_piece() -> None:
    outgoing = OutgoingSnapshot(chunk_bytes=4)
    packs = []

    def pack() -> tuple[int, bytes]:
        packs.append(1)
        return 7, b"0123456789"

    assert outgoing.piece(0, pack) == (7, 10, b"0123")
    assert outgoing.piece(4, pack) == (7, 10, b"4567")
    assert outgoing.piece(8, pack) == (7, 10, b"89")
    assert len(packs) == 1
    with pytest.raises(BadRequest):  # read whole: it is gone
        outgoing.piece(4, pack)


# ---- snapshots over the wire ------------------------------------------------------------------------------
def _shard(n: int) -> ShardIndex:
    settings = SearchParams(embedder="none").settings()
    shard = ShardIndex(settings)
    for seq in range(1, n + 1):
        shard.apply(LogEntry(seq=seq, ops=[Upsert(doc=Document(id=f"d{seq}", text=f"word{seq}"))]))
    return shard


def test_an_index_travels_packed_and_arrives_whole() -> None:
    shard = _shard(5)
    data = shard.packed()
    pieces = snapshot.chunks(data, 100)
    assert len(pieces) > 1 and b"".join(pieces) == data
    copy = ShardIndex.unpacked(data, shard.settings)
    assert (copy.applied_seq, copy.documents) == (5, 5)
    assert copy.get("d3") == shard.get("d3")
    with pytest.raises(CorruptSnapshot):
        ShardIndex.unpacked(data[:-3], shard.settings)
    seq, files, meta = snapshot.unpack(data)
    files["docs.msgpack"] = b"x" + files["docs.msgpack"][1:]
    with pytest.raises(CorruptSnapshot):
        snapshot.unpack(snapshot._packer.encode((seq, files, {n: 0 for n in files}, meta)))


def test_a_snapshot_kept_in_data_dir_is_sent_as_it_was_received(tmp_path: Path) -> None:
    shard = _shard(3)
    seq, files, meta = snapshot.unpack(shard.packed())
    snapshot.write(tmp_path / "snap", seq, files, meta)
    found = snapshot.read_packed(tmp_path / "snap")
    assert found is not None and found[0] == 3
    assert ShardIndex.unpacked(found[1], shard.settings).documents == 3
    assert snapshot.read_packed(tmp_path / "none") is None
    assert wire.piece(wire.encode((3, 10, b"abc"))) == (3, 10, b"abc")


# ---- a new writer's log -----------------------------------------------------------------------------------
def test_a_wal_reset_starts_after_the_seq_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "wal"
    with WriteAheadLog(path) as wal:
        wal.append([LogEntry(seq=s, ops=[]) for s in (1, 2, 3)])
        wal.reset(10)
        assert wal.last_seq == 10 and list(wal.read_from(0)) == []
        wal.append([LogEntry(seq=11, ops=[])])
    with WriteAheadLog(path) as again:  # as found after a restart
        assert again.base_seq == 10 and [e.seq for e in again.read_from(0)] == [11]


async def test_a_log_refuses_writes_while_its_front_end_does_not_write_and_rebases(tmp_path: Path) -> None:
    writing = {"now": False}

    def gate(shard: int) -> WorkerUnavailable | None:
        return None if writing["now"] else WorkerUnavailable("not the writer", 5.0)

    log = ShardLog(0, tmp_path / "wal", gate)
    with pytest.raises(WorkerUnavailable) as refused:
        await log.append([])
    assert refused.value.retry_after_s == 5.0
    assert log.durable_seq == 0
    writing["now"] = True
    assert await log.append([]) == 1
    await log.rebase(7)  # the snapshot taken over holds everything up to 7; the own entry 1 goes
    assert (log.durable_seq, log.first_seq, log.tail) == (7, 8, [])
    assert await log.append([]) == 8
    assert [e.seq for e in log.entries_after(7, 10) or []] == [8]
    log.close(WorkerUnavailable("stopped"))


def test_each_front_end_of_a_host_keeps_its_own_files(tmp_path: Path) -> None:
    store = IndexStore(tmp_path)
    assert store.wal_path("i", 0) == tmp_path / "indexes" / "i" / "shard-0" / "wal"
    assert store.wal_path("i", 0, "1") != store.wal_path("i", 0, "2") != store.wal_path("i", 0)
    assert store.snapshot_path("i", 1, "host:80/1").name == "snapshot.host_80_1"
    assert store.written_epoch("i") == 0
    store.save_written_epoch("i", 4)
    store.save_written_epoch("i", 9, "1")
    assert (store.written_epoch("i"), store.written_epoch("i", "1")) == (4, 9)
