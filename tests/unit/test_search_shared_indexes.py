"""Search indexes created or deleted through the API with several front ends, through the shared store
(kinds/search/shared_indexes.py): what the `decider` lease's holder (the owner, below) writes and waits for,
and what another front end serves. On MemoryStore and a fake clock."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inferd.clock import FakeClock
from inferd.cluster import reports
from inferd.cluster.follower import Follower
from inferd.cluster.lease import LEASE
from inferd.cluster.memory import MemoryState, MemoryStore
from inferd.cluster.store import Fenced, Grant, StoreUnavailable, Versioned
from inferd.config import ModelConfig
from inferd.errors import ClusterUnavailable, NotFound, ServingError
from inferd.kinds.search import shared_indexes
from inferd.kinds.search.config import index_config, params_of, parse_params
from inferd.kinds.search.indexes import IndexAdmin
from inferd.kinds.search.kind import search_kind
from inferd.kinds.search.shared_indexes import (
    INDEXES,
    INDEXES_DOC,
    SERVING_DOC,
    SERVING_PREFIX,
    IndexesDoc,
    ServingDoc,
    SharedIndexes,
)
from inferd.kinds.search.store import IndexStore
from inferd.runtime.kinds import KindRegistry


class Registry:
    """The few ModelRegistry calls SharedIndexes makes, over search runtimes that hold only a config."""

    def __init__(self) -> None:
        self.served: dict[str, SimpleNamespace] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.served

    def names(self, kinds: frozenset[str] | None = None) -> list[str]:
        return sorted(self.served)

    def get(self, name: str) -> SimpleNamespace:
        return self.served[name]


class Server:
    def __init__(self) -> None:
        self.registry = Registry()
        self.kinds = KindRegistry([search_kind()])
        self.added: list[tuple[str, int]] = []
        self.config = SimpleNamespace(data_dir=Path("/nonexistent/data_dir"))

    def add_version(self, config: ModelConfig) -> None:
        self.registry.served[config.name] = SimpleNamespace(config=config, version=config.version)
        self.added.append((config.name, params_of(config).shards))

    def remove_version(self, name: str, version: int, why: ServingError | None = None) -> None:
        assert isinstance(why, NotFound)  # what still reaches a deleted index is told it is gone
        del self.registry.served[name]


def index(name: str, **settings: Any) -> ModelConfig:
    return index_config(name, parse_params(settings, "test"))


class Flaky(MemoryStore):
    """A MemoryStore that refuses one document's writes, or every read_prefix, as a store that does not
    answer."""

    refuse: str | None = None
    refuse_prefix = False

    async def write(self, doc: str, body: bytes, **kw: Any) -> int:
        if doc == self.refuse:
            raise StoreUnavailable(f"writes of {doc} refused by the test")
        return await super().write(doc, body, **kw)

    async def read_prefix(self, prefix: str) -> dict[str, Versioned]:
        if self.refuse_prefix:
            raise StoreUnavailable("read_prefix refused by the test")
        return await super().read_prefix(prefix)


class Holding:
    """The `decider` lease as a front end holds it: `grant` while it acts as the holder, else None."""

    def __init__(self) -> None:
        self.grant: Grant | None = None

    def __call__(self) -> Grant | None:
        return self.grant


def site(
    store: MemoryStore, clock: FakeClock, name: str, owner: bool, holding: Holding | None = None
) -> tuple[SharedIndexes, Server, Follower]:
    """Front end `name`; `owner`: it holds the `decider` lease (a grant the store gives it now)."""
    server, follower = Server(), Follower(store, clock)
    holding = holding or Holding()
    if owner:
        holding.grant = store.state.acquire(LEASE, name, 3600.0)
    return SharedIndexes(store, follower, server, name, holding, clock), server, follower


async def report(store: MemoryStore, frontend: str, serving: list[str]) -> None:
    await store.write(
        SERVING_PREFIX + frontend, SERVING_DOC.encode(ServingDoc(serving)), ttl_s=shared_indexes.REPORT_TTL_S
    )


async def publish(store: MemoryStore, settings: dict[str, dict[str, Any]]) -> None:
    await INDEXES_DOC.update(store, lambda _: IndexesDoc(settings))


# ---- the owner's waits --------------------------------------------------------------------------------
async def test_a_new_index_waits_only_for_the_front_ends_up_that_do_not_serve_it() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    owner, _, _ = site(store, clock, "0", owner=True)
    assert missing(await owner.reports(), "notes") == []  # no front end heard of: nobody to wait for
    await report(store, "1", ["docs"])
    await report(store, "2", ["docs", "notes"])
    await report(store, "0", [])  # the owner's own report (if any) is never waited for
    assert missing(await owner.reports(), "notes") == ["1"]
    clock.advance(1.0)
    await report(store, "1", ["docs", "notes"])
    assert missing(await owner.reports(), "notes") == []
    await report(store, "2", ["docs"])  # it has not caught up with a delete and a new create yet
    assert missing(await owner.reports(), "notes") == ["2"]
    clock.advance(2.5)  # silent since: down (it serves the owner's indexes when it starts again)
    assert missing(await owner.reports(), "notes") == []


async def test_a_deleted_index_waits_for_the_front_ends_up_that_still_serve_it() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    owner, _, _ = site(store, clock, "0", owner=True)
    await report(store, "1", ["docs", "notes"])
    await report(store, "2", ["docs"])
    assert still_serving(await owner.reports(), "notes") == ["1"]
    await report(store, "1", ["docs"])
    assert still_serving(await owner.reports(), "notes") == []


async def test_the_owner_answers_a_delete_once_the_others_dropped_the_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shared_indexes, "FOLLOWERS_WAIT_S", 3600.0)  # only the report can end the wait
    monkeypatch.setattr(reports, "RECHECK_S", 0.001)
    clock = FakeClock()
    store = MemoryStore(clock)
    owner, _, _ = site(store, clock, "0", owner=True)
    await report(store, "1", ["notes"])
    deleted = asyncio.create_task(owner.until_followers_drop("notes"))
    await asyncio.sleep(0.01)  # it waits
    await report(store, "1", ["notes"])  # not yet
    await asyncio.sleep(0.01)
    assert not deleted.done()
    _, doc = await INDEXES_DOC.read(store)
    assert doc.settings == {}  # published before it waits
    await report(store, "1", [])
    await asyncio.wait_for(deleted, 30)  # a guard: a wait that missed the report fails here


async def test_a_new_index_is_published_and_served_by_the_others_before_the_owner_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shared_indexes, "FOLLOWERS_WAIT_S", 3600.0)
    monkeypatch.setattr(reports, "RECHECK_S", 0.001)
    clock = FakeClock()
    store = MemoryStore(clock)
    owner, owner_server, _ = site(store, clock, "0", owner=True)
    other, other_server, follower = site(store, clock, "1", owner=False)
    await other.report()
    owner_server.add_version(index("notes", shards=2))
    waiting = asyncio.create_task(owner.until_followers_serve("notes"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    assert await follower.read_all()  # the follow loop applies the owner's document, and reports
    await asyncio.wait_for(waiting, 30)
    assert other_server.added == [("notes", 2)]


async def test_a_wait_the_store_cannot_answer_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_indexes, "FOLLOWERS_WAIT_S", 3600.0)
    clock = FakeClock()
    store = Flaky(clock)
    owner, _, _ = site(store, clock, "0", owner=True)
    store.refuse_prefix = True
    await asyncio.wait_for(owner.until_followers_serve("notes"), 30)  # logged, not raised


async def test_the_owner_writes_its_indexes_again_after_a_refused_write() -> None:
    clock = FakeClock()
    store = Flaky(clock)
    owner, server, _ = site(store, clock, "0", owner=True)
    server.add_version(index("notes", shards=1))
    store.refuse = INDEXES
    with pytest.raises(StoreUnavailable):
        await owner.publish()
    store.refuse = None
    await owner.publish()
    revision, doc = await INDEXES_DOC.read(store)
    assert list(doc.settings) == ["notes"]
    await owner.publish()  # unchanged: not written again
    assert (await INDEXES_DOC.read(store))[0] == revision


# ---- what another front end serves --------------------------------------------------------------------
async def test_an_older_document_applied_after_a_newer_one_does_not_bring_back_a_deleted_index() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    other, server, _ = site(store, clock, "1", owner=False)
    await publish(store, {"notes": {"shards": 1}})
    older = await store.read(INDEXES)
    await publish(store, {})  # deleted meanwhile
    await other.refresh()
    await other._apply(older)  # a read of before the delete, applied late
    assert server.registry.names() == []  # the newer document is the last word
    assert server.added == []


async def test_an_index_created_again_with_other_settings_is_served_anew() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    other, server, _ = site(store, clock, "1", owner=False)
    await publish(store, {"notes": {"shards": 1}})
    await other.refresh()
    await publish(store, {"notes": {"shards": 2}})  # deleted and created again between two reads
    await other.refresh()
    assert server.added == [("notes", 1), ("notes", 2)]
    assert params_of(server.registry.get("notes").config).shards == 2
    assert (await other.reports()) == {}  # its own report is not among the others'
    found = await store.read(SERVING_PREFIX + "1")
    assert SERVING_DOC.decode(found)[1].serving == ["notes"]


async def test_a_document_never_written_keeps_the_indexes_served_and_the_same_settings_keep_an_index() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    other, server, _ = site(store, clock, "1", owner=False)
    server.add_version(index("docs", shards=3))  # data_dir's, or the model repository's
    await other.refresh()
    assert server.registry.names() == ["docs"]
    await publish(store, {"docs": params_of(server.registry.get("docs").config).model_dump()})
    await other.refresh()
    assert server.added == [("docs", 3)]  # the same settings: kept as it is


async def test_a_report_is_written_again_before_it_expires() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    other, _, _ = site(store, clock, "1", owner=False)
    owner, _, _ = site(store, clock, "0", owner=True)
    await other.report()
    for _ in range(10):
        clock.advance(shared_indexes.REPORT_TTL_S / 4)
        await other.report()
        assert list(await owner.reports()) == ["1"]


async def test_the_owner_writes_a_change_at_once_and_looks_again_at_its_document_now_and_then() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    owner, server, _ = site(store, clock, "0", owner=True)
    server.add_version(index("notes", shards=1))
    await owner._keep_published()
    assert list((await INDEXES_DOC.read(store))[1].settings) == ["notes"]
    server.add_version(index("docs", shards=1))
    await owner._keep_published()  # changed: written at once
    assert sorted((await INDEXES_DOC.read(store))[1].settings) == ["docs", "notes"]
    await store.delete(INDEXES)  # a store that lost it
    await owner._keep_published()
    assert await store.read(INDEXES) is None  # unchanged here: not read again yet
    clock.advance(shared_indexes.CONFIRM_EVERY_S)
    await owner._keep_published()
    assert sorted((await INDEXES_DOC.read(store))[1].settings) == ["docs", "notes"]


async def test_a_refresh_the_store_cannot_answer_leaves_it_to_the_follow_loop() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    other, server, follower = site(store, clock, "1", owner=False)
    await publish(store, {"notes": {"shards": 1}})

    async def down(doc: str) -> None:
        raise StoreUnavailable("down for the test")

    store.read = down  # type: ignore[method-assign]
    await other.refresh()  # logged, not raised: the forwarded write's answer stands
    assert server.registry.names() == []
    del store.read
    assert await follower.read_all()
    assert server.registry.names() == ["notes"]


async def test_settings_that_msgpack_turns_into_other_types_are_not_written_again() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    owner, server, _ = site(store, clock, "0", owner=True)
    server.registry.served["notes"] = SimpleNamespace(config=SimpleNamespace(params={"fields": ("a", "b")}))
    await owner.publish()
    revision = (await INDEXES_DOC.read(store))[0]
    await owner.publish()  # a tuple reads back as a list: still the same settings
    assert (await INDEXES_DOC.read(store))[0] == revision == 1


async def test_a_follower_serves_the_owners_indexes_again_after_the_store_lost_its_data() -> None:
    """A Redis restarted empty numbers revisions from 1 again: a document written anew at a revision
    the follower saw already, with other indexes, is applied all the same."""
    clock = FakeClock()
    store = MemoryStore(clock)
    _, server, loop = site(store, clock, "1", owner=False)
    for names in (["a"], ["a", "b"]):  # revisions 1 and 2
        await publish(store, {n: params_of(index(n)).model_dump() for n in names})
        await loop.read_all()
    assert server.registry.names() == ["a", "b"]
    store.state = MemoryState(clock)  # the store lost everything
    await publish(store, {"c": params_of(index("c")).model_dump()})  # revision 1 again, other bytes
    await loop.read_all()
    assert server.registry.names() == ["c"]

def missing(found: dict[str, frozenset[str]], name: str) -> list[str]:
    """The front ends (of the reports: those up) that do not serve `name` yet."""
    return sorted(f for f, serving in found.items() if name not in serving)


def still_serving(found: dict[str, frozenset[str]], name: str) -> list[str]:
    """The front ends up that serve `name` still (a deleted index)."""
    return sorted(f for f, serving in found.items() if name in serving)


# ---- one document for the whole server, written by the decider lease's holder ----------------------------
async def test_a_deposed_holders_write_is_refused_and_only_a_holder_writes() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    holding = Holding()
    old, server, _ = site(store, clock, "a", owner=True, holding=holding)
    server.add_version(index("notes", shards=1))
    await old.publish()
    assert list((await INDEXES_DOC.read(store))[1].settings) == ["notes"]
    deposed = holding.grant
    assert deposed is not None
    store.state.release(deposed)
    assert store.state.acquire(LEASE, "b", 3600.0) is not None  # the lease moved to front end b
    server.add_version(index("docs", shards=1))
    with pytest.raises(Fenced):  # it still believes it holds it (a paused process): the store says no
        await old.publish()
    holding.grant = None  # it knows it lost it: it does not even try
    await old.publish()
    assert list((await INDEXES_DOC.read(store))[1].settings) == ["notes"]


async def test_a_new_holder_catches_up_with_the_document_before_it_writes_it() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a_holding, b_holding = Holding(), Holding()
    a, a_server, _ = site(store, clock, "a", owner=True, holding=a_holding)
    b, b_server, _ = site(store, clock, "b", owner=False, holding=b_holding)
    a_server.add_version(index("notes", shards=1))
    await a.publish()
    await b.refresh()
    assert b_server.registry.names() == ["notes"]
    del a_server.registry.served["notes"]  # a deletes it; b has not read the document since
    await a.publish()
    assert a_holding.grant is not None
    store.state.release(a_holding.grant)
    a_holding.grant, b_holding.grant = None, store.state.acquire(LEASE, "b", 3600.0)
    revision = (await INDEXES_DOC.read(store))[0]
    await b.publish()  # b holds the lease now: it applies the deletion first, and writes nothing back
    assert b_server.registry.names() == []
    assert (await INDEXES_DOC.read(store)) == (revision, IndexesDoc({}))


class Supervisor:
    """The local workers of a front end that runs them: slots per index."""

    def __init__(self) -> None:
        self.slots: dict[str, list[SimpleNamespace]] = {}
        self.killed: list[str] = []

    def add(self, model: str, n: int, version: int | None) -> None:
        self.slots.setdefault(model, []).extend(
            SimpleNamespace(incarnation=f"{model}-{i}") for i in range(n)
        )

    def live_slots(self, model: str) -> list[SimpleNamespace]:
        return list(self.slots.get(model, []))

    def retire(self, slot: SimpleNamespace) -> None:
        for slots in self.slots.values():
            if slot in slots:
                slots.remove(slot)

    def kill(self, incarnation: str) -> None:
        self.killed.append(incarnation)


async def test_the_first_front_end_of_each_host_starts_and_retires_its_share_of_an_indexs_workers() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    runs, other = Server(), Server()
    runs.supervisor, other.supervisor = Supervisor(), Supervisor()  # type: ignore[attr-defined]
    sites = [
        SharedIndexes(store, Follower(store, clock), s, name, Holding(), clock, supervises=supervises)
        for s, name, supervises in ((runs, "b/0", True), (other, "b/1", False))
    ]
    await publish(store, {"notes": {"shards": 2, "replicas": 2, "embedder": "none"}})
    for s in sites:
        await s.refresh()
    assert len(runs.supervisor.live_slots("notes")) == 4  # type: ignore[attr-defined]
    assert other.supervisor.live_slots("notes") == []  # type: ignore[attr-defined]
    assert runs.registry.names() == other.registry.names() == ["notes"]
    await publish(store, {})
    for s in sites:
        await s.refresh()
    assert runs.supervisor.live_slots("notes") == [] and len(runs.supervisor.killed) == 4  # type: ignore[attr-defined]
    assert runs.registry.names() == other.registry.names() == []


async def test_every_front_end_reports_what_it_serves_the_holder_too() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    holder, server, _ = site(store, clock, "a", owner=True)
    other, _, _ = site(store, clock, "b", owner=False)
    server.add_version(index("notes", shards=1))
    runs = asyncio.create_task(holder.run())
    try:
        await asyncio.sleep(0.05)
    finally:
        runs.cancel()
    assert await other.reports() == {"a": frozenset({"notes"})}
    assert list((await INDEXES_DOC.read(store))[1].settings) == ["notes"]


class AdminServer(Server):
    """A front end as IndexAdmin sees it (its index_sync, supervisor and directory); a new index is ready
    at once."""

    def __init__(self) -> None:
        super().__init__()
        self.index_sync: SharedIndexes | None = None
        self.supervisor = Supervisor()
        self.directory = None

    def add_version(self, config: ModelConfig) -> SimpleNamespace:  # type: ignore[override]
        super().add_version(config)
        self.registry.served[config.name].ready = True
        self.registry.served[config.name].kind = "search"
        return self.registry.served[config.name]


async def test_a_new_holder_behind_the_document_keeps_the_index_it_creates(tmp_path: Path) -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a_holding, b_holding = Holding(), Holding()
    a, a_server, _ = site(store, clock, "a", owner=True, holding=a_holding)
    b_server = AdminServer()
    b = SharedIndexes(store, Follower(store, clock), b_server, "b", b_holding, clock)
    b_server.index_sync = b
    a_server.add_version(index("notes", shards=1))
    await a.publish()  # b has not read the document yet (its follow loop is behind)
    assert a_holding.grant is not None
    store.state.release(a_holding.grant)
    a_holding.grant, b_holding.grant = None, store.state.acquire(LEASE, "b", 3600.0)
    admin = IndexAdmin(b_server, IndexStore(tmp_path), max_workers=16)  # type: ignore[arg-type]
    assert await admin.create("docs", parse_params({"shards": 1}, "test")) is True
    assert b_server.registry.names() == ["docs", "notes"]  # the index it answered 201 for is served
    assert sorted((await INDEXES_DOC.read(store))[1].settings) == ["docs", "notes"]
    assert b_server.supervisor.live_slots("docs")
    await b.publish()
    assert b_server.registry.names() == ["docs", "notes"]


async def test_an_index_deleted_elsewhere_leaves_no_log_on_this_host_for_one_created_again(tmp_path: Path) -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    server = Server()
    server.config = SimpleNamespace(data_dir=tmp_path)
    files = IndexStore(tmp_path)
    b = SharedIndexes(store, Follower(store, clock), server, "b", Holding(), clock)
    await publish(store, {"notes": {"shards": 1, "embedder": "none"}, "kept": {"shards": 1, "embedder": "none"}})
    await b.refresh()
    assert server.registry.names() == ["kept", "notes"]
    for name in ("notes", "kept"):  # this front end wrote them (it was their writer): its logs in data_dir
        files.wal_path(name, 0).parent.mkdir(parents=True)
        files.wal_path(name, 0).write_bytes(b"entries")
        files.save_written_epoch(name, 3)
    declared = files.wal_path("repo", 0)  # an index of the model repository served here too
    declared.parent.mkdir(parents=True)
    declared.write_bytes(b"entries")
    server.add_version(index("repo", shards=1))
    await publish(store, {"kept": {"shards": 1, "embedder": "none"}})  # notes deleted (through another host)
    await b.refresh()
    assert server.registry.names() == ["kept"]
    # its log would be taken for the index's if one were created again under its name (its writer here
    # trusts its own log when no replica is further: a new index's replicas start empty)
    assert not files.folder("notes").exists()
    assert files.wal_path("kept", 0).is_file() and files.written_epoch("kept") == 3
    assert declared.is_file()  # dropped here, never erased: the repository declares it


async def test_an_index_the_store_did_not_take_is_not_answered_created_nor_left_half_made(tmp_path: Path) -> None:
    clock = FakeClock()
    store = Flaky(clock)
    holding = Holding()
    server = AdminServer()
    holder = SharedIndexes(store, Follower(store, clock), server, "a", holding, clock)
    server.index_sync = holder
    holding.grant = store.state.acquire(LEASE, "a", 3600.0)
    admin = IndexAdmin(server, IndexStore(tmp_path), max_workers=16)  # type: ignore[arg-type]
    store.refuse = INDEXES  # the store takes no write of the server's indexes now
    with pytest.raises(ClusterUnavailable):  # 503: never a 201 for an index the other front ends never hear of
        await admin.create("docs", parse_params({"shards": 1}, "test"))
    assert server.registry.names() == [] and not IndexStore(tmp_path).folder("docs").exists()
    assert server.supervisor.live_slots("docs") == []
    store.refuse = None
    assert await admin.create("docs", parse_params({"shards": 1}, "test")) is True  # tried again: made
    assert list((await INDEXES_DOC.read(store))[1].settings) == ["docs"]
    store.refuse = INDEXES
    with pytest.raises(ClusterUnavailable):  # a delete the document does not say yet is not answered done
        await admin.delete("docs")
    store.refuse, holding.grant = None, None  # it no longer holds the lease (it lapsed meanwhile)
    with pytest.raises(ClusterUnavailable, match="no longer decides"):
        await admin.create("notes", parse_params({"shards": 1}, "test"))
    assert "notes" not in server.registry.names()
