"""Search with several front ends: a follower's view of the shards (kinds/search/follower.py), the writes it
forwards to the front end that runs them (frontends/search_writes.py, over frontends/channel.py) once their
bodies pass the writer's own parsing (api/search_routes.py), and the replica that serves every front end
(kinds/search/replica.py's links and notes)."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from inferd.api.search_routes import SearchRoutes
from inferd.errors import (
    BadRequest,
    Conflict,
    Internal,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    WorkerUnavailable,
)
from inferd.frontends.channel import PeerUnreachable
from inferd.frontends.plan import FrontendPlan
from inferd.frontends.search_writes import (
    HERE,
    KIND,
    Forwarder,
    Nobody,
    Write,
    WriteDesk,
    forwarded_writes,
    refusal,
    route_document,
    route_index_op,
)
from inferd.kinds.search import wire
from inferd.kinds.search.config import SearchParams
from inferd.kinds.search.follower import KnownSeqs, Note, take_note
from inferd.kinds.search.replica import Replica
from inferd.kinds.search.replicas import Replica as ReplicaView
from inferd.kinds.search.replicas import ReplicaPhase, least_served_shard
from inferd.kinds.search.requests import MAX_BATCH_DOCUMENTS
from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.types import Document, IndexSettings, LogEntry, Upsert
from inferd.kinds.search.wire import ANNOUNCE
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerState


def view(shard: int = -1, phase: ReplicaPhase = ReplicaPhase.ASSIGNING) -> ReplicaView:
    conn = SimpleNamespace(worker_id="w", state=WorkerState.READY)
    return ReplicaView(conn, shard, phase)  # type: ignore[arg-type]


# ---- KnownSeqs and notes --------------------------------------------------------------------------------
def test_known_seqs_only_move_forward_and_say_when_they_did() -> None:
    known = KnownSeqs(2)
    assert known.learn(0, 3) is True
    assert known.learn(0, 2) is False and known.seqs == [3, 0]
    assert known.learn(-1, 9) is False and known.learn(2, 9) is False  # not a shard of the index
    assert known.written([3, 0]) is False
    assert known.written([3, 5]) is True and known.seqs == [3, 5]


def test_behind_lists_the_shards_a_search_must_wait_for() -> None:
    known = KnownSeqs(3)
    known.written([4, 2, 0])
    assert known.behind([4, 3, 1]) == {1: 3, 2: 1}
    assert known.behind([1, 1, 0]) == {}


async def test_a_note_makes_a_replica_serve_its_shard_and_a_move_fails_its_calls() -> None:
    r = view()
    assert take_note(r, Note(1, 7, 10)) is False  # nothing in flight to fail
    assert (r.shard, r.phase, r.applied_seq, r.documents) == (1, ReplicaPhase.SERVING, 7, 10)
    r.pending[5] = asyncio.get_running_loop().create_future()  # a call in flight
    assert take_note(r, Note(1, 9, 11)) is False  # same shard, progress: calls stand
    assert take_note(r, Note(-1, 0, 0)) is True  # it loads another shard: its calls fail
    assert r.phase is ReplicaPhase.ASSIGNING and not r.readable


def test_a_replica_not_assigned_yet_counts_for_no_shard() -> None:
    replicas = [view(-1), view(0, ReplicaPhase.SERVING), view(-1)]
    assert least_served_shard(2, replicas) == 1


# ---- forwarded writes -----------------------------------------------------------------------------------
async def test_the_writers_answer_and_errors_come_back_as_they_were() -> None:
    async def execute(write: Write) -> tuple[bytes, bool]:
        if write.key == "missing":
            raise NotFound("no document 'missing'")
        if write.key == "clash":
            raise Conflict("index 'docs' exists with other settings")
        if write.key == "busy":
            raise WorkerUnavailable("embedder down", retry_after_s=3.0)
        if write.key == "full":
            raise Overloaded("embedder queue full", 2.0)
        if write.key == "tenant":
            raise RateLimited("tenant over its rate", 4.0)
        return b'{"seq": [1, 0]}', False

    registry = CollectorRegistry()
    desk = WriteDesk(execute, forwarded_writes(registry))

    async def ask(to: str, kind: str, payload: bytes, timeout_s: float) -> bytes:
        assert (to, kind) == ("unix:/writer.sock", KIND)
        return await desk.answer(payload)

    forwarder = Forwarder(ask, {"w": "unix:/writer.sock"}.get)
    assert await forwarder.forward(Write("delete", "docs", key="d1"), "w") == (b'{"seq": [1, 0]}', False)
    with pytest.raises(NotFound, match="no document 'missing'"):
        await forwarder.forward(Write("delete", "docs", key="missing"), "w")
    with pytest.raises(Conflict):
        await forwarder.forward(Write("delete", "docs", key="clash"), "w")
    with pytest.raises(WorkerUnavailable) as busy:
        await forwarder.forward(Write("delete", "docs", key="busy"), "w")
    assert busy.value.retry_after_s == 3.0
    with pytest.raises(Overloaded) as full:  # a 429 stays a 429, with the owner's Retry-After
        await forwarder.forward(Write("delete", "docs", key="full"), "w")
    assert full.value.retry_after_s == 2.0
    with pytest.raises(RateLimited) as tenant:
        await forwarder.forward(Write("delete", "docs", key="tenant"), "w")
    assert tenant.value.retry_after_s == 4.0
    counted = {
        outcome: registry.get_sample_value(
            "inferd_search_forwarded_writes_total", {"op": "delete", "outcome": outcome}
        )
        for outcome in ("ok", "NotFound", "Conflict", "WorkerUnavailable", "Overloaded", "RateLimited")
    }
    assert counted == dict.fromkeys(counted, 1.0)


async def test_a_write_while_its_writer_is_away_is_a_retryable_503_naming_it() -> None:
    async def ask(to: str, kind: str, payload: bytes, timeout_s: float) -> bytes:
        raise PeerUnreachable("ConnectionRefusedError")

    with pytest.raises(WorkerUnavailable, match="front end 'w' writes the index") as exc:
        await Forwarder(ask, {"w": "unix:/w.sock"}.get).forward(Write("upsert", "docs", body=b"{}"), "w")
    assert exc.value.retry_after_s > 0
    with pytest.raises(WorkerUnavailable, match="no address to reach it by"):  # its record expired
        await Forwarder(ask, {}.get).forward(Write("upsert", "docs", body=b"{}"), "w")
    with pytest.raises(WorkerUnavailable, match="'d' holds the lease of the server's decisions"):
        await Forwarder(ask, {"d": "10.0.0.2:4000"}.get).forward(Write("create", "docs", body=b"{}"), "d")


# ---- where a write runs ---------------------------------------------------------------------------------
class Lease:
    """An index's writer as kinds/search/writers.py answers: `writes` here, or `holder` elsewhere."""

    def __init__(self, writes: bool = False, holder: str | None = None, retry_after_s: float = 5.0) -> None:
        self._writes, self.holder, self._retry = writes, holder, retry_after_s

    def writes(self) -> bool:
        return self._writes

    def writer(self) -> str | None:
        return "me" if self._writes else self.holder

    def retry_after_s(self) -> float:
        return self._retry

    def taking_over(self) -> int | None:
        return None


def test_a_document_write_runs_on_the_indexs_writer_and_an_index_op_on_the_decider() -> None:
    upsert = Write("upsert", "docs")
    assert route_document(upsert, Lease(writes=True), "me") == HERE
    assert route_document(upsert, Lease(holder="b"), "me") == "b"
    nobody = route_document(upsert, Lease(retry_after_s=5.0), "me")  # the lease free
    assert isinstance(nobody, Nobody) and nobody.retry_after_s == 5.0 and "no writer" in nobody.why
    taking_over = route_document(upsert, Lease(holder="me"), "me")  # named, but its takeover runs
    assert isinstance(taking_over, Nobody)
    assert route_index_op("me", "me") == HERE and route_index_op("d", "me") == "d"
    assert isinstance(route_index_op(None, "me"), Nobody)  # no decider now
    refused = refusal(Nobody("index 'docs' has no writer now", 5.0))
    assert refused.retry_after_s == 5.0 and "retry" in refused.message


class Peers:
    """The peers a SearchRoutes sees: the channel (what was forwarded where; nobody answers) and the
    address book."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, bytes]] = []
        self.handlers: dict[str, object] = {}
        self.channel = self

    def handle(self, kind: str, handler: object, timeout_s: float) -> None:
        self.handlers[kind] = handler

    async def ask_watched(self, to: str, kind: str, payload: bytes, timeout_s: float) -> bytes:
        self.asked.append((to, payload))
        raise PeerUnreachable("ConnectionRefusedError")

    def address(self, frontend: str) -> str | None:
        return f"unix:/{frontend}.sock"


class Store:
    def __init__(self, holder: str | None) -> None:
        self.grant = None if holder is None else SimpleNamespace(holder=holder)

    async def holder(self, lease: str) -> object:
        return self.grant


def routes_on(tmp_path: Path, me: str = "1", decider: str | None = "0") -> tuple[SearchRoutes, Peers]:
    """A SearchRoutes on front end `me` of one host's two (front end 0 writes every index and decides)."""
    peers = Peers()
    server = SimpleNamespace(
        config=SimpleNamespace(data_dir=tmp_path, max_body_bytes=2**20),
        frontend=FrontendPlan(int(me), 2, str(tmp_path), "token"),
        peers=peers,
        metrics=SimpleNamespace(registry=CollectorRegistry()),
        cluster=SimpleNamespace(
            me=me, versions=SimpleNamespace(holds=lambda: decider == me), store=Store(decider)
        ),
        index_sync=SimpleNamespace(),
        registry=SimpleNamespace(),
    )
    return SearchRoutes(server), peers


def follower_routes(tmp_path: Path) -> tuple[SearchRoutes, Peers]:
    return routes_on(tmp_path)


async def test_a_write_forwarded_to_a_front_end_that_does_not_run_it_is_refused_not_forwarded_again(
    tmp_path: Path,
) -> None:
    routes, peers = routes_on(tmp_path, me="1", decider="0")  # front end 1: neither writer nor decider
    routes.admin.find = lambda name: SimpleNamespace(name=name, writer=Lease(holder="0"))  # type: ignore[method-assign]
    for write in (Write("upsert", "docs", body=b"{}"), Write("create", "notes", body=b"{}")):
        with pytest.raises(WorkerUnavailable, match="does not") as refused:
            await routes.run_forwarded(write)
        assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    assert peers.asked == []
    assert KIND in peers.handlers  # every front end answers forwarded writes


async def test_an_index_op_goes_to_the_decider_and_none_is_a_503_after_the_bodys_check(
    tmp_path: Path,
) -> None:
    routes, peers = routes_on(tmp_path, me="1", decider="0")
    with pytest.raises(WorkerUnavailable, match="front end '0' holds the lease"):
        await routes.write(Write("create", "notes", body=b'{"embedder": "none"}'))
    assert [to for to, _ in peers.asked] == ["unix:/0.sock"]
    routes, peers = routes_on(tmp_path, me="1", decider=None)
    with pytest.raises(BadRequest, match="shards"):  # a bad body is a 400 whoever decides
        await routes.write(Write("create", "notes", body=b'{"shards": 0}'))
    with pytest.raises(WorkerUnavailable, match="no front end holds the lease") as refused:
        await routes.write(Write("create", "notes", body=b'{"embedder": "none"}'))
    assert refused.value.retry_after_s is not None and peers.asked == []


@pytest.mark.parametrize(
    ("body", "error", "names"),
    [
        (b"{not json", BadRequest, "not valid JSON"),
        (b'{"documents": []}', BadRequest, "non-empty list"),
        (b'{"documents": [{"id": "a", "text": "x"}], "extra": 1}', BadRequest, "unknown keys ['extra']"),
        (b'{"documents": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]}', BadRequest, "same id"),
        (b'{"documents": [{"id": "a", "text": "x", "fields": {"year": "old"}}]}', BadRequest, "year"),
        (
            b'{"documents": [%s]}' % b",".join([b'{"id": "a", "text": "x"}'] * (MAX_BATCH_DOCUMENTS + 1)),
            PayloadTooLarge,
            "split it",
        ),
    ],
)
async def test_a_follower_refuses_a_bad_upsert_itself_and_never_forwards_it(
    tmp_path: Path, body: bytes, error: type[Exception], names: str
) -> None:
    routes, peers = follower_routes(tmp_path)
    index = SimpleNamespace(params=SearchParams(embedder="none", fields={"year": "int"}), writer=Lease(holder="0"))
    with pytest.raises(error, match=re.escape(names)):
        await routes.write(Write("upsert", "docs", body=body), index)
    assert peers.asked == []
    with pytest.raises(WorkerUnavailable):  # a good one is forwarded (the owner is away here)
        await routes.write(Write("upsert", "docs", body=b'{"documents": [{"id": "a", "text": "x"}]}'), index)
    assert len(peers.asked) == 1


@pytest.mark.parametrize(
    ("name", "body", "names"),
    [
        ("notes", b"[1, 2]", "must be a JSON object"),
        ("notes", b'{"shards": 0}', "shards"),
        ("notes", b'{"settings": {"embedder": "none", "colour": "red"}}', "colour"),
        ("no/te s", b'{"embedder": "none"}', "index name"),
    ],
)
async def test_a_follower_refuses_bad_index_settings_itself_and_never_forwards_them(
    tmp_path: Path, name: str, body: bytes, names: str
) -> None:
    routes, peers = follower_routes(tmp_path)
    with pytest.raises(BadRequest, match=names):
        await routes.write(Write("create", name, body=body))
    assert peers.asked == []
    with pytest.raises(WorkerUnavailable):
        await routes.write(Write("create", "notes", body=b'{"embedder": "none"}'))
    assert len(peers.asked) == 1


# ---- the replica shared by several front ends ----------------------------------------------------------
class Link:
    """A front end's side of one link: what the replica wrote to it (its own transport too)."""

    def __init__(self, stalled: bool = False) -> None:
        self.frames: list[bytes] = []
        self.answered = asyncio.Event()
        """Set by the answer to call 1."""
        self.stalled = stalled
        """A front end that stopped reading: the link's buffer only grows, a drain never returns."""
        self.aborted = False
        self.transport = self

    def write(self, data: bytes) -> None:
        self.frames.append(data)
        message = p.decode_message(data[4:])
        if isinstance(message, p.ShardReply) and message.call_id == 1:
            self.answered.set()

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 2**40 if self.stalled else 0

    async def drain(self) -> None:
        if self.stalled:
            await asyncio.Event().wait()

    def messages(self) -> list[p.Message]:
        return [p.decode_message(f[4:]) for f in self.frames]


def notes(link: Link) -> list[int]:
    return [
        wire.number(m.body) for m in link.messages() if isinstance(m, p.ShardReply) and m.call_id == ANNOUNCE
    ]


async def test_readers_learn_the_shard_and_progress_and_cannot_drain_the_replica(tmp_path: Path) -> None:
    replica = Replica("w")
    owner, reader = Link(), Link()
    settings = wire.encode(SearchParams(embedder="none").settings())
    from_owner, from_reader = asyncio.StreamReader(), asyncio.StreamReader()
    from_owner.feed_data(p.encode_frame(p.ShardAssign(1, settings)))
    entry = LogEntry(seq=1, ops=[Upsert(doc=Document(id="a", text="alpha"))])
    from_owner.feed_data(p.encode_frame(p.ShardCall(1, "apply", wire.encode([entry]))))
    from_owner.feed_data(p.encode_frame(p.Drain()))
    from_reader.feed_data(p.encode_frame(p.Drain()))  # a reading front end cannot retire the replica
    served = [
        asyncio.create_task(replica.serve(0, from_owner, owner, 1, 3600.0)),  # type: ignore[arg-type]
        asyncio.create_task(replica.serve(1, from_reader, reader, 1, 3600.0)),  # type: ignore[arg-type]
    ]
    assert await asyncio.gather(*served) == ["drained", "drained"]  # the writer's Drain ends both
    assert notes(owner) == [-1]  # when it joined: no shard held; then only answers
    assert [r.call_id for r in owner.messages() if isinstance(r, p.ShardReply)] == [ANNOUNCE, 0, 1]
    assert notes(reader) == [-1, -1, 1, 1]  # joined; loading; serving shard 1; applied
    progress = [m for m in reader.messages() if isinstance(m, p.ShardReply)][-1]
    assert (progress.applied_seq, progress.documents) == (1, 1)


async def writer_comes_back(tmp_path: Path, readers: int) -> Link:
    """The owner front end assigns shard 0 and applies seq 1, dies, and is started again (while `readers`
    other front ends stay): the new owner's link."""
    replica = Replica("w")
    reader_feed = asyncio.StreamReader()
    reading = [
        asyncio.create_task(replica.serve(1, reader_feed, Link(), 1, 3600.0))  # type: ignore[arg-type]
        for _ in range(readers)
    ]
    settings = wire.encode(SearchParams(embedder="none").settings())
    entry = LogEntry(seq=1, ops=[Upsert(doc=Document(id="a", text="alpha"))])
    for _ in range(2):  # the owner front end, then the one started again after it died
        link, feed = Link(), asyncio.StreamReader()
        feed.feed_data(p.encode_frame(p.ShardAssign(0, settings)))
        feed.feed_data(p.encode_frame(p.ShardCall(1, "apply", wire.encode([entry]))))
        session = asyncio.create_task(replica.serve(0, feed, link, 1, 3600.0))  # type: ignore[arg-type]
        await link.answered.wait()  # the apply's answer: then the front end goes
        feed.feed_eof()
        assert await session == "lost"
    reader_feed.feed_eof()
    assert await asyncio.gather(*reading) == ["lost"] * readers
    return link


async def test_a_writer_that_comes_back_keeps_the_index_another_front_end_kept(tmp_path: Path) -> None:
    link = await writer_comes_back(tmp_path, readers=1)
    assigned = [m for m in link.messages() if isinstance(m, p.ShardReply) and m.call_id == 0]
    assert notes(link) == [0]  # it told the new writer the shard it holds
    assert [(a.applied_seq, a.documents) for a in assigned] == [(1, 1)]  # kept, not reloaded empty


async def test_a_replica_no_front_end_kept_starts_afresh_as_with_one_front_end(tmp_path: Path) -> None:
    link = await writer_comes_back(tmp_path, readers=0)
    assigned = [m for m in link.messages() if isinstance(m, p.ShardReply) and m.call_id == 0]
    assert notes(link) == [-1]  # it holds nothing for the front end that comes: assigned and loaded anew
    assert [(a.applied_seq, a.documents) for a in assigned] == [(0, 0)]  # from data_dir (no snapshot)


async def test_a_front_end_joining_while_the_replica_loads_another_shard_hears_it_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replica = Replica("w")
    owner = Link()
    settings = wire.encode(SearchParams(embedder="none").settings())
    from_owner = asyncio.StreamReader()
    from_owner.feed_data(p.encode_frame(p.ShardAssign(0, settings)))
    entries = [LogEntry(seq=s, ops=[Upsert(doc=Document(id=f"d{s}", text="alpha"))]) for s in (1, 2, 3)]
    from_owner.feed_data(p.encode_frame(p.ShardCall(1, "apply", wire.encode(entries))))
    writing = asyncio.create_task(replica.serve(0, from_owner, owner, 1, 3600.0))  # type: ignore[arg-type]
    await owner.answered.wait()  # shard 0 at seq 3
    loading, release = threading.Event(), threading.Event()

    def slow_load(data: bytes, settings: IndexSettings) -> ShardIndex:
        loading.set()
        release.wait(30)
        return ShardIndex(settings)  # the snapshot sent held nothing

    monkeypatch.setattr(ShardIndex, "unpacked", slow_load)
    from_owner.feed_data(p.encode_frame(p.ShardAssign(1, settings, snapshot=b"a snapshot")))
    await asyncio.to_thread(loading.wait, 30)
    joiner = Link()
    joining = asyncio.create_task(replica.serve(1, asyncio.StreamReader(), joiner, 1, 3600.0))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # it joined: its first note is out
    release.set()
    from_owner.feed_data(p.encode_frame(p.Drain()))
    assert await asyncio.wait_for(asyncio.gather(writing, joining), 30) == ["drained", "drained"]
    joined = [m for m in joiner.messages() if isinstance(m, p.ShardReply)]
    assert [(wire.number(m.body), m.applied_seq) for m in joined] == [(-1, 0), (1, 0)]  # never (1, 3)


async def test_a_reading_front_end_that_stopped_reading_holds_up_no_other_link(tmp_path: Path) -> None:
    replica = Replica("w")
    owner, stalled = Link(), Link(stalled=True)
    settings = wire.encode(SearchParams(embedder="none").settings())
    from_owner = asyncio.StreamReader()
    from_owner.feed_data(p.encode_frame(p.ShardAssign(0, settings)))
    for seq in (1, 2, 3):
        entry = LogEntry(seq=seq, ops=[Upsert(doc=Document(id=f"d{seq}", text="alpha"))])
        from_owner.feed_data(p.encode_frame(p.ShardCall(seq, "apply", wire.encode([entry]))))
    from_owner.feed_data(p.encode_frame(p.Drain()))
    reading = asyncio.create_task(replica.serve(1, asyncio.StreamReader(), stalled, 1, 3600.0))  # type: ignore[arg-type]
    writing = replica.serve(0, from_owner, owner, 1, 3600.0)  # type: ignore[arg-type]
    assert await asyncio.wait_for(writing, 30) == "drained"  # a guard: the bug was a hang
    assert await reading == "drained"
    answered = [m.call_id for m in owner.messages() if isinstance(m, p.ShardReply)]
    assert answered == [ANNOUNCE, 0, 1, 2, 3]
    assert stalled.aborted  # dropped: its front end rejoins and hears the replica's state again


async def test_a_replica_whose_calls_runner_fails_ends_its_links_instead_of_going_silent(
    tmp_path: Path,
) -> None:
    replica = Replica("w")
    owner, reader = Link(), Link()
    from_owner = asyncio.StreamReader()
    from_owner.feed_data(p.encode_frame(p.ShardAssign(0, b"\xc1 not settings")))
    served = [
        asyncio.create_task(replica.serve(0, from_owner, owner, 1, 3600.0)),  # type: ignore[arg-type]
        asyncio.create_task(replica.serve(1, asyncio.StreamReader(), reader, 1, 3600.0)),  # type: ignore[arg-type]
    ]
    done, _ = await asyncio.wait(served, timeout=30)  # a guard: the bug was a hang
    assert len(done) == 2
    for session in served:
        with pytest.raises(ExceptionGroup) as failed:
            session.result()
        assert isinstance(failed.value.exceptions[0], Internal)
        assert "DecodeError" in str(failed.value.exceptions[0])


async def test_a_replica_every_front_end_left_takes_a_writer_of_any_epoch_again() -> None:
    replica = Replica("w")
    settings = wire.encode(SearchParams(embedder="none").settings())
    answers = []
    for epoch in (5, 1):  # the front end started again on a store that numbers its epochs anew
        link, feed = Link(), asyncio.StreamReader()
        feed.feed_data(p.encode_frame(p.ShardAssign(0, settings, epoch=epoch)))
        feed.feed_data(p.encode_frame(p.ShardCall(1, "applied")))
        session = asyncio.create_task(replica.serve(0, feed, link, 1, 3600.0))  # type: ignore[arg-type]
        await link.answered.wait()
        feed.feed_eof()
        assert await session == "lost"
        answers.append([m for m in link.messages() if isinstance(m, p.ShardReply) and m.call_id != ANNOUNCE])
    for epoch, replies in zip((5, 1), answers, strict=True):
        assert [(r.call_id, r.error) for r in replies] == [(0, None), (1, None)]
        assert wire.pair(replies[1].body) == (0, epoch)  # serves shard 0, built under that writer


class Counting(Store):
    """The store of `routes_on`, counting the times it is asked who holds a lease."""

    def __init__(self, holder: str | None) -> None:
        super().__init__(holder)
        self.asked = 0

    async def holder(self, lease: str) -> object:
        self.asked += 1
        return await super().holder(lease)


class TakingOver(Lease):
    """This front end holds the index's writer lease and its takeover runs: it writes nothing yet."""

    def taking_over(self) -> int | None:
        return 7


async def test_a_write_during_this_front_ends_takeover_is_a_503_without_asking_the_store(tmp_path: Path) -> None:
    routes, peers = routes_on(tmp_path, me="1", decider="1")
    store = routes.server.cluster.store = Counting("1")  # the store names this front end: it holds the lease
    upsert = Write("upsert", "docs", body=b'{"documents": [{"id": "a", "text": "x"}]}')
    for _ in range(3):
        to = await routes.route(upsert, SimpleNamespace(writer=TakingOver()))
        assert isinstance(to, Nobody) and to.retry_after_s == 5.0
    assert store.asked == 0  # no store round trip per write while the takeover runs
    assert await routes.route(upsert, SimpleNamespace(writer=Lease(holder=None))) == Nobody(
        "index 'docs' has no writer now (its lease is being taken over)", 5.0
    )
    assert store.asked == 1  # no writer known here: the store's word is asked (it may be new since)
    store.grant = SimpleNamespace(holder="2")
    assert await routes.route(upsert, SimpleNamespace(writer=Lease(holder=None))) == "2"
    assert peers.asked == []
