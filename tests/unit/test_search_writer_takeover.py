"""A search index's writer dies and another front end takes the index over: two front ends' runtimes
(kinds/search/runtime.py) sharing one MemoryStore on a FakeClock for the writer lease, and real shard
replicas (kinds/search/replica.py) joined to both over socket pairs.

The lease's time is the FakeClock's: a writer 'stopped' (SIGSTOP) is one that renews nothing while the
test moves the clock past its ttl."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from inferd.clock import FakeClock
from inferd.cluster.memory import MemoryStore
from inferd.config import ServerConfig
from inferd.errors import WorkerUnavailable
from inferd.kinds.search import snapshot, takeover, wire
from inferd.kinds.search.config import SearchParams, index_config
from inferd.kinds.search.replica import Replica
from inferd.kinds.search.runtime import SearchRuntime
from inferd.kinds.search.sequencer import ShardLog
from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.store import IndexStore
from inferd.kinds.search.types import Document, LogEntry, Upsert
from inferd.kinds.search.writers import IndexWriter
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.runtime.kinds import RuntimeContext
from inferd.runtime.membership import WorkerDirectory
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState

TTL = 0.3
"""The lease's ttl: on the FakeClock for the grants, in real seconds for the driver's tries (ttl/3)."""


@dataclass
class FrontEnd:
    name: str
    rt: SearchRuntime
    links: dict[str, tuple[WorkerConnection, asyncio.StreamWriter]] = field(default_factory=dict)
    tasks: list[asyncio.Task] = field(default_factory=list)


@dataclass
class Cluster:
    clock: FakeClock
    store: MemoryStore
    replicas: dict[str, Replica]
    front_ends: dict[str, FrontEnd]
    tasks: list[asyncio.Task] = field(default_factory=list)


def front_end(name: str, tmp: Path, clock: FakeClock, store: MemoryStore, snapshot_every: int = 1000) -> FrontEnd:
    params = SearchParams(shards=1, replicas=2, embedder="none", snapshot_every=snapshot_every)
    config = index_config("docs", params)
    ctx = RuntimeContext(
        ServerConfig(data_dir=tmp / name),
        clock,
        Metrics(),
        RetryBudget(clock),
        lambda w: None,
        WorkerDirectory(clock),
        shared_store=lambda: (store, name),
    )
    rt = SearchRuntime(config, ctx, IndexStore(tmp / name))
    rt.writer = IndexWriter("docs", name, clock, TTL)  # every front end contends (separate hosts)
    return FrontEnd(name, rt)


async def join(fe: FrontEnd, replica: Replica, link: int) -> None:
    """The replica joins the front end over a socket pair, as a worker does (the hub's part, reduced)."""
    ours, theirs = socket.socketpair()
    w_reader, w_writer = await asyncio.open_connection(sock=theirs)
    f_reader, f_writer = await asyncio.open_connection(sock=ours)
    conn = WorkerConnection(replica.worker_id, "docs", 1, f"host-{replica.worker_id}", f_writer)
    fe.tasks.append(asyncio.create_task(replica.serve(link, w_reader, w_writer, 1, 3600.0)))
    assert isinstance(await p.read_message(f_reader), p.Ready)
    conn.state = WorkerState.READY
    fe.rt.add_worker(conn)
    fe.links[replica.worker_id] = (conn, w_writer)

    async def read() -> None:
        while True:
            msg = await p.read_message(f_reader)
            if isinstance(msg, p.Heartbeat):
                continue
            fe.rt.on_message(conn, msg)

    fe.tasks.append(asyncio.create_task(read()))


@contextlib.asynccontextmanager
async def cluster(tmp: Path) -> AsyncIterator[Cluster]:
    clock = FakeClock()
    store = MemoryStore(clock)
    c = Cluster(clock, store, {n: Replica(n) for n in ("r1", "r2")}, {})
    try:
        yield c
    finally:
        for fe in c.front_ends.values():
            fe.rt.stop(WorkerUnavailable("the test ends"))
            for conn, writer in fe.links.values():
                conn.writer.close()
                writer.close()
            for task in fe.tasks:
                task.cancel()
        for task in c.tasks:
            task.cancel()
        await asyncio.gather(*c.tasks, *(t for fe in c.front_ends.values() for t in fe.tasks), return_exceptions=True)


async def start(c: Cluster, fe: FrontEnd) -> None:
    c.front_ends[fe.name] = fe
    c.tasks.append(asyncio.create_task(fe.rt.run()))


async def until(check: Callable[[], object], what: str, timeout_s: float = 20.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not check():  # noqa: ASYNC110 - state of other objects: the replicas, the lease's tries
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"timed out waiting until {what}")


def docs(*ids: int) -> list[Document]:
    return [Document(id=f"d{i}", text=f"word{i} common") for i in ids]


def held(replica: Replica) -> list[str]:
    """The ids of the documents the replica's index holds, each as often as it is held."""
    assert replica.index is not None
    return sorted(d.id for d in replica.index._docs if d is not None)


def serving(fe: FrontEnd, n: int) -> bool:
    return sum(1 for r in fe.rt.replicas.values() if r.readable) == n


async def test_a_new_writer_takes_over_from_the_highest_replica_and_the_old_one_is_refused(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path) as c:
        a = front_end("a", tmp_path, c.clock, c.store)
        b = front_end("b", tmp_path, c.clock, c.store)
        await start(c, a)
        await until(a.rt.writer.writes, "a writes the index")
        await start(c, b)
        for replica in c.replicas.values():
            await join(a, replica, 0)
            await join(b, replica, 1)
        await until(lambda: serving(a, 2), "both replicas serve on a")
        assert b.rt.writer.writer() in ("a", None)
        await until(lambda: b.rt.writer.writer() == "a", "b knows a writes")

        acked = []
        for i in range(1, 6):  # both replicas apply these
            await a.rt.index.upsert(docs(i))
            acked.append(f"d{i}")
        await until(lambda: all(r.index and r.index.applied_seq == 5 for r in c.replicas.values()), "both at 5")

        # r2 loses its link to a (it keeps its index: b still holds it); a goes on with r1 alone
        conn_r2, writer_r2 = a.links.pop("r2")
        writer_r2.close()
        conn_r2.writer.close()
        a.rt.on_worker_lost(conn_r2, "the test cut it")
        await until(lambda: c.replicas["r2"].writer_link is None, "r2 left by a")
        for i in range(6, 9):
            await a.rt.index.upsert(docs(i))
            acked.append(f"d{i}")
        assert c.replicas["r1"].index.applied_seq == 8 and c.replicas["r2"].index.applied_seq == 5  # type: ignore[union-attr]

        # a is stopped: it renews nothing, and its grant runs out on the clock
        a.rt.writer.contends = False
        c.clock.advance(TTL * 1.2)
        assert not a.rt.writer.writes()
        with pytest.raises(WorkerUnavailable) as refused:
            await a.rt.index.upsert(docs(99))
        assert refused.value.retry_after_s == TTL

        await until(b.rt.writer.writes, "b took the index over")
        assert b.rt.logs[0].durable_seq == 8  # the highest replica's seq: r1's
        assert IndexStore(tmp_path / "b").written_epoch("docs", "") > 1  # b's own file, under its epoch
        await until(lambda: serving(b, 2), "both replicas serve b")
        await until(lambda: c.replicas["r2"].index is not None and c.replicas["r2"].index.applied_seq == 8, "r2 at 8")

        await b.rt.index.upsert(docs(9))  # the next entry: seq 9
        acked.append("d9")
        await until(lambda: all(r.index and r.index.applied_seq == 9 for r in c.replicas.values()), "both at 9")
        for replica in c.replicas.values():
            assert held(replica) == sorted(acked)  # every acknowledged document, once each
            assert replica.fence.epoch == b.rt.writer.epoch()

        # a resumes: it writes nothing, ships nothing, and the replicas refuse what it would send
        assert not a.rt.writer.writes() and a.rt.writer.writer() in ("b", None)
        with pytest.raises(WorkerUnavailable):
            await a.rt.index.upsert(docs(100))
        conn_r1, _ = a.links["r1"]
        stale = LogEntry(seq=10, ops=[Upsert(doc=Document(id="stale", text="stale"))])
        conn_r1.send(p.ShardCall(10_000, "apply", wire.encode([stale])))
        conn_r1.send(p.ShardAssign(0, wire.encode(a.rt.settings), epoch=1))
        await b.rt.index.upsert(docs(10))  # ordered after a's messages on r1
        acked.append("d10")
        await until(lambda: all(r.index and r.index.applied_seq == 10 for r in c.replicas.values()), "both at 10")
        for replica in c.replicas.values():
            assert held(replica) == sorted(acked)
        found = await b.rt.index.get("d7", c.clock.now() + 5)
        assert found.id == "d7"


async def test_snapshots_travel_as_bytes_into_the_writers_data_dir_and_to_a_joining_replica(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path) as c:
        a = front_end("a", tmp_path, c.clock, c.store, snapshot_every=3)
        await start(c, a)
        await until(a.rt.writer.writes, "a writes the index")
        await join(a, c.replicas["r1"], 0)
        await until(lambda: serving(a, 1), "r1 serves")
        for i in range(1, 8):
            await a.rt.index.upsert(docs(i))
        path = IndexStore(tmp_path / "a").snapshot_path("docs", 0)
        await until(lambda: snapshot.current_seq(path) >= 6, "a snapshot of r1's index in a's data_dir")
        await until(lambda: a.rt.logs[0].first_seq > 1, "the log before it dropped")
        assert not (tmp_path / "r1").exists()  # no replica writes a data_dir
        late = Replica("r3")
        await join(a, late, 0)
        await until(lambda: late.index is not None and late.index.applied_seq == 7, "r3 loaded and caught up")
        assert held(late) == [f"d{i}" for i in range(1, 8)]


async def test_a_write_no_replica_applied_before_its_writer_lapsed_is_not_acknowledged(tmp_path: Path) -> None:
    async with cluster(tmp_path) as c:
        a = front_end("a", tmp_path, c.clock, c.store)
        await start(c, a)
        await until(a.rt.writer.writes, "a writes the index")
        writing = asyncio.create_task(a.rt.index.upsert(docs(1)))  # no replica: nobody applies it
        await until(lambda: a.rt.logs[0].durable_seq == 1, "logged")
        assert not writing.done()
        a.rt.writer.contends = False  # stopped: its grant runs out
        c.clock.advance(TTL * 1.2)
        with pytest.raises(WorkerUnavailable) as refused:
            await asyncio.wait_for(writing, 10)
        assert "no longer writes" in refused.value.message


async def test_a_shard_it_cannot_source_refuses_writes_until_a_replica_answers(tmp_path: Path) -> None:
    async with cluster(tmp_path) as c:
        b = front_end("b", tmp_path, c.clock, c.store)
        b.rt.known.learn(0, 4)  # it heard of seq 4 (a replica's note), its own log is empty
        replica = c.replicas["r1"]
        replica.index = ShardIndex(b.rt.settings)  # the replica holds seq 4 of a writer gone
        for seq in range(1, 5):
            replica.index.apply(LogEntry(seq=seq, ops=[Upsert(doc=Document(id=f"d{seq}", text="x"))]))
        replica.shard, replica.settings = 0, wire.encode(b.rt.settings)
        await start(c, b)
        await until(lambda: not b.rt.writer.contending(), "b found nothing to take the shard from: it stood down")
        assert await c.store.holder(b.rt.writer.lease) is None  # let go, for another to take
        assert not b.rt.writer.writes() and b.rt.writer.writer() is None
        with pytest.raises(WorkerUnavailable):
            await b.rt.index.upsert(docs(9))
        await join(b, replica, 0)
        c.clock.advance(TTL)  # its time standing down is over
        await until(b.rt.writer.writes, "b took the index over from r1")
        assert b.rt.logs[0].durable_seq == 4
        await b.rt.index.upsert(docs(5))
        assert held(replica) == [f"d{i}" for i in range(1, 6)]


async def test_after_a_whole_restart_only_the_last_writers_own_log_is_the_index(tmp_path: Path) -> None:
    async with cluster(tmp_path) as c:
        a = front_end("a", tmp_path, c.clock, c.store)
        await start(c, a)
        await until(a.rt.writer.writes, "a writes the index")
        await join(a, c.replicas["r1"], 0)
        await until(lambda: serving(a, 1), "r1 serves a")
        for i in range(1, 4):
            await a.rt.index.upsert(docs(i))
        # the whole server stops: a, and its replica (which starts again empty)
        a.rt.stop(WorkerUnavailable("stopped"))
        for task in a.tasks:
            task.cancel()
        c.tasks[0].cancel()
        await asyncio.gather(c.tasks[0], *a.tasks, return_exceptions=True)
        del c.front_ends["a"]
        c.clock.advance(TTL * 2)
        # b, whose data_dir holds an older log of its own (it wrote seq 1 under epoch 1 long ago)
        b_store = IndexStore(tmp_path / "b")
        shard_log = ShardLog(0, b_store.wal_path("docs", 0))
        await shard_log.append([Upsert(doc=Document(id="old", text="old"))])
        shard_log.close(WorkerUnavailable("closed"))
        b_store.save_written_epoch("docs", 0)
        b = front_end("b", tmp_path, c.clock, c.store)
        await start(c, b)
        fresh = Replica("r2")
        await join(b, fresh, 0)
        await until(lambda: not b.rt.writer.contending(), "b stood down: its log is not the last writer's")
        assert not b.rt.writer.writes()
        # a starts again: its own log is the index
        a2 = front_end("a", tmp_path, c.clock, c.store)
        await start(c, a2)
        await join(a2, fresh, 1)
        await until(a2.rt.writer.writes, "a took the index over from its own log")
        await until(lambda: fresh.index is not None and fresh.index.applied_seq == 3, "r2 replayed a's log")
        assert held(fresh) == ["d1", "d2", "d3"]


async def test_a_replica_holding_a_deposed_writers_entries_past_the_takeover_does_not_keep_them(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path) as c:
        a = front_end("a", tmp_path, c.clock, c.store)
        b = front_end("b", tmp_path, c.clock, c.store)
        await start(c, a)
        await until(a.rt.writer.writes, "a writes the index")
        await start(c, b)
        r1, r2 = c.replicas["r1"], c.replicas["r2"]
        await join(a, r1, 0)
        await join(b, r1, 1)
        await join(a, r2, 0)  # r2 does not reach b yet
        await until(lambda: serving(a, 2), "both replicas serve a")
        for i in range(1, 4):
            await a.rt.index.upsert(docs(i))
        await until(lambda: all(r.index and r.index.applied_seq == 3 for r in (r1, r2)), "both at 3")
        conn_r1, writer_r1 = a.links.pop("r1")  # r1 no longer reaches a
        writer_r1.close()
        conn_r1.writer.close()
        a.rt.on_worker_lost(conn_r1, "the test cut it")

        gate = threading.Event()
        assert r2.index is not None
        applying = r2.index.apply

        def slow_apply(entry: LogEntry) -> None:
            gate.wait(30)
            applying(entry)

        r2.index.apply = slow_apply  # type: ignore[method-assign]
        write = asyncio.create_task(a.rt.index.upsert(docs(4)))
        await until(lambda: a.rt.logs[0].durable_seq == 4, "a logged d4 (seq 4) and shipped it to r2")
        a.rt.writer.contends = False  # a stops before r2 applies it
        c.clock.advance(TTL * 1.2)
        gate.set()
        with pytest.raises(WorkerUnavailable):  # not acknowledged: its writer lapsed first
            await asyncio.wait_for(write, 10)
        await until(lambda: r2.index is not None and r2.index.applied_seq == 4, "r2 applied a's seq 4")

        await until(b.rt.writer.writes, "b took over from r1, at seq 3")
        assert b.rt.logs[0].durable_seq == 3
        await b.rt.index.upsert(docs(5))  # b's own seq 4
        await join(b, r2, 1)  # r2 holds a's seq 4 (d4): it must not keep it as b's seq 4
        await b.rt.index.upsert(docs(6))
        await until(lambda: all(r.index and r.index.applied_seq == 5 for r in (r1, r2)), "both at 5")
        assert held(r1) == held(r2) == ["d1", "d2", "d3", "d5", "d6"]


async def test_a_replica_that_cannot_reach_the_log_without_a_snapshot_is_drained_not_reassigned_forever(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path) as c:
        a = front_end("a", tmp_path, c.clock, c.store, snapshot_every=3)
        await start(c, a)
        await until(a.rt.writer.writes, "a writes the index")
        await join(a, c.replicas["r1"], 0)
        await until(lambda: serving(a, 1), "r1 serves")
        for i in range(1, 8):
            await a.rt.index.upsert(docs(i))
        await until(lambda: a.rt.logs[0].first_seq > 1, "a snapshot taken and the log before it dropped")
        shutil.rmtree(IndexStore(tmp_path / "a").snapshot_path("docs", 0))  # lost from data_dir
        late = Replica("r3")
        await join(a, late, 0)
        conn, _ = a.links["r3"]
        await until(lambda: conn.state is WorkerState.DRAINING, "r3 drained")
        assert late.index is None or late.index.applied_seq == 0  # drained: it exits, holding nothing
        assert not any(r.readable for r in a.rt.replicas.values() if r.worker_id == "r3")


async def test_a_takeover_waits_for_a_live_replica_that_answers_late_and_loses_no_acknowledged_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(takeover, "ASK_S", 0.2)
    async with cluster(tmp_path) as c:
        a = front_end("a", tmp_path, c.clock, c.store)
        b = front_end("b", tmp_path, c.clock, c.store)
        await start(c, a)
        await until(a.rt.writer.writes, "a writes the index")
        await start(c, b)
        r1, r2 = c.replicas["r1"], c.replicas["r2"]
        for replica in (r1, r2):
            await join(a, replica, 0)
            await join(b, replica, 1)
        await until(lambda: serving(a, 2), "both replicas serve on a")
        await until(lambda: b.rt.writer.writer() == "a", "b knows a writes")
        acked = []
        for i in range(1, 4):
            await a.rt.index.upsert(docs(i))
            acked.append(f"d{i}")
        conn_r2, writer_r2 = a.links.pop("r2")  # r2 no longer reaches a: a goes on with r1 alone
        writer_r2.close()
        conn_r2.writer.close()
        a.rt.on_worker_lost(conn_r2, "the test cut it")
        for i in range(4, 7):
            await a.rt.index.upsert(docs(i))  # acknowledged: r1 applied them
            acked.append(f"d{i}")
        assert r1.index is not None and r1.index.applied_seq == 6

        gate = threading.Event()  # r1 is busy (a long call on its thread): it answers the takeover late
        calling = r1._call

        def late(msg: p.ShardCall) -> p.ShardReply:
            if msg.op == "applied":
                gate.wait(30)
            return calling(msg)

        r1._call = late  # type: ignore[method-assign]
        a.rt.writer.contends = False  # a is stopped: its grant runs out
        c.clock.advance(TTL * 1.2)
        await until(lambda: b.rt.writer.writes() or not b.rt.writer.contending(), "b tried to take over")
        assert not b.rt.writer.writes()  # not from r2 at seq 3: r1, alive, holds acknowledged seqs 4-6
        gate.set()
        c.clock.advance(TTL)  # its time standing down is over
        await until(b.rt.writer.writes, "b took the index over")
        assert b.rt.logs[0].durable_seq == 6
        await b.rt.index.upsert(docs(7))
        acked.append("d7")
        await until(lambda: all(r.index and r.index.applied_seq == 7 for r in (r1, r2)), "both at 7")
        assert held(r1) == held(r2) == sorted(acked)
