"""The store's semantics (cluster/store.py's doc), the same tests against its three implementations:
MemoryStore on a fake clock, the parent's store of `--frontends N` (a real Unix socket, its server in a
thread of this process), and RedisStore (a real redis-server, tests/redis_server.py).

Where time matters, the memory store's clock is moved; the real stores get short ttls and the tests poll
for the outcome, never asserting how long it took."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from inferd.clock import FakeClock, MonotonicClock
from inferd.cluster.follower import Follower
from inferd.cluster.local import LocalStoreClient, LocalStoreServer
from inferd.cluster.memory import MemoryStore
from inferd.cluster.redis_store import RedisStore
from inferd.cluster.store import Fenced, RevisionConflict, Store, StoreUnavailable, Versioned
from tests.conftest import free_port
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)

LONG_TTL_S = 60.0
"""A ttl no test outlives."""
EVENTUALLY_S = 15.0
"""How long a real store gets to show an expiry before the test fails (a bound, not a measurement)."""
PROBE = "probe"


@dataclass
class Harness:
    """One store, a way to open more clients on it, and its time."""

    store: Store
    more: Callable[[], Store]
    clock: FakeClock | None
    short_ttl_s: float
    """A ttl the test waits out."""
    opened: list[Store] = field(default_factory=list)

    def client(self) -> Store:
        """Another front end's client of the same store."""
        store = self.more()
        self.opened.append(store)
        return store

    async def pass_time(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            await asyncio.sleep(seconds)

    async def eventually(self, check: Callable[[], Awaitable[bool]]) -> None:
        """`check()` holds once the short ttl has passed (at once on the fake clock, polled on a real one)."""
        if self.clock is not None:
            self.clock.advance(self.short_ttl_s)
            assert await check()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EVENTUALLY_S
        while not await check():
            assert loop.time() < deadline, f"not so after {EVENTUALLY_S} s"
            await asyncio.sleep(0.02)


@pytest.fixture(params=["memory", "local", "redis"])
async def h(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    server: LocalStoreServer | None = None
    if request.param == "memory":
        clock = FakeClock()
        memory = MemoryStore(clock)
        harness = Harness(memory, lambda: memory, clock, short_ttl_s=5.0)
    elif request.param == "local":
        server = LocalStoreServer(str(tmp_path / "store.sock"), "token", MonotonicClock())
        await asyncio.to_thread(server.start)
        path = server.path
        harness = Harness(LocalStoreClient(path, "token"), lambda: LocalStoreClient(path, "token"), None, 0.2)
    else:
        url = request.getfixturevalue("redis_server").url
        harness = Harness(RedisStore(url, timeout_s=5.0), lambda: RedisStore(url, timeout_s=5.0), None, 0.2)
    harness.opened.append(harness.store)
    try:
        yield harness
    finally:
        for store in harness.opened:
            await store.close()
        if server is not None:
            await asyncio.to_thread(server.stop)


async def watching(store: Store) -> AsyncIterator[str]:
    """A watch that is open: PROBE is written until it reports it (a real store subscribes asynchronously)."""
    names = store.watch()
    first = asyncio.ensure_future(anext(names))
    while not first.done():
        await store.write(PROBE, b"")
        await asyncio.wait([first], timeout=0.05)
    assert first.result() == PROBE
    return names


async def next_name(names: AsyncIterator[str]) -> str:
    """The next name other than the probe's."""
    while True:
        name = await asyncio.wait_for(anext(names), EVENTUALLY_S)
        if name != PROBE:
            return name


async def test_a_document_is_written_read_and_deleted_with_revisions_that_never_repeat(h: Harness) -> None:
    s = h.store
    assert await s.read("served") is None
    assert await s.write("served", b"v1") == 1
    assert await s.write("served", b"v2") == 2
    found = await s.read("served")
    assert found is not None and (found.revision, found.body) == (2, b"v2")
    await s.delete("served")
    await s.delete("served")  # nothing to delete: no error
    assert await s.read("served") is None
    assert await s.write("served", b"v3") == 3  # written again: its revisions go on
    other = await h.client().read("served")
    assert other is not None and other.body == b"v3"


async def test_compare_and_set_writes_only_at_the_expected_revision(h: Harness) -> None:
    s = h.store
    assert await s.write("canary", b"a", expect=0) == 1
    with pytest.raises(RevisionConflict) as conflict:
        await s.write("canary", b"b", expect=0)
    assert (conflict.value.expected, conflict.value.actual) == (0, 1)
    assert await s.write("canary", b"b", expect=1) == 2
    with pytest.raises(RevisionConflict) as stale:
        await h.client().write("canary", b"late", expect=1)
    assert (stale.value.doc, stale.value.expected, stale.value.actual) == ("canary", 1, 2)
    found = await s.read("canary")
    assert found is not None and (found.revision, found.body) == (2, b"b")


async def test_a_document_with_a_ttl_expires_unless_written_again(h: Harness) -> None:
    s = h.store
    await s.write("load/a", b"kept", ttl_s=LONG_TTL_S)
    assert await s.write("load/b", b"gone", ttl_s=h.short_ttl_s / 2) == 1
    await s.write("config", b"ttl then none", ttl_s=h.short_ttl_s / 2)
    await s.write("config", b"stays")  # written without a ttl: it no longer expires
    await h.eventually(lambda: _absent(s, "load/b"))
    kept = await s.read("load/a")
    assert kept is not None and kept.body == b"kept"
    stays = await s.read("config")
    assert stays is not None and stays.body == b"stays"
    assert await s.write("load/b", b"back", ttl_s=LONG_TTL_S) == 2  # a reader never sees revision 1 twice


async def _absent(store: Store, doc: str) -> bool:
    return await store.read(doc) is None


async def test_read_prefix_returns_the_live_documents_under_a_prefix(h: Harness) -> None:
    s = h.store
    await s.write("load/a", b"1", ttl_s=LONG_TTL_S)
    await s.write("load/b", b"2")
    await s.write("load/c", b"3")
    await s.write("load/old", b"4", ttl_s=h.short_ttl_s / 2)
    await s.write("loader", b"5")
    await s.write("frontend/x", b"6")
    await s.delete("load/c")
    await h.eventually(lambda: _absent(s, "load/old"))
    found = await h.client().read_prefix("load/")
    assert {name: (v.revision, v.body) for name, v in found.items()} == {"load/a": (1, b"1"), "load/b": (1, b"2")}
    assert await s.read_prefix("nothing/") == {}


async def test_a_lease_is_granted_to_one_holder_and_renewed_with_the_same_epoch(h: Harness) -> None:
    a, b = h.store, h.client()
    grant = await a.acquire("decider", "fe-a", LONG_TTL_S)
    assert grant is not None and (grant.lease, grant.holder, grant.epoch) == ("decider", "fe-a", 1)
    assert await b.acquire("decider", "fe-b", LONG_TTL_S) is None
    renewed = await a.acquire("decider", "fe-a", LONG_TTL_S)
    assert renewed is not None and renewed.epoch == 1
    current = await b.holder("decider")
    assert current is not None and (current.holder, current.epoch) == ("fe-a", 1)
    assert 0 < current.ttl_s <= LONG_TTL_S
    assert await b.holder("other") is None


async def test_an_expired_lease_goes_to_another_with_a_higher_epoch_and_epochs_never_go_back(h: Harness) -> None:
    a, b = h.store, h.client()
    first = await a.acquire("decider", "fe-a", h.short_ttl_s / 2)
    assert first is not None and first.epoch == 1
    await h.eventually(lambda: _free(b, "decider"))
    second = await b.acquire("decider", "fe-b", LONG_TTL_S)
    assert second is not None and (second.holder, second.epoch) == ("fe-b", 2)
    await b.release(second)
    third = await a.acquire("decider", "fe-a", LONG_TTL_S)
    assert third is not None and third.epoch == 3
    other = await a.acquire("autoscaler", "fe-a", LONG_TTL_S)
    assert other is not None and other.epoch == 1  # each lease its own epochs


async def _free(store: Store, lease: str) -> bool:
    return await store.holder(lease) is None


async def test_a_holder_renewing_after_its_lease_expired_gets_a_new_epoch(h: Harness) -> None:
    s = h.store
    old = await s.acquire("decider", "fe-a", h.short_ttl_s / 2)
    assert old is not None
    await h.eventually(lambda: _free(s, "decider"))
    new = await s.acquire("decider", "fe-a", LONG_TTL_S)
    assert new is not None and new.epoch == old.epoch + 1
    with pytest.raises(Fenced):  # what it decided under the old grant is not written under the new
        await s.write("served", b"late", fence=old)
    assert await s.write("served", b"now", fence=new) == 1


async def test_concurrent_compare_and_set_updates_lose_nothing(h: Harness) -> None:
    clients = [h.store, h.client(), h.client()]
    each = 15

    async def add_one(store: Store) -> None:
        for _ in range(each):
            while True:
                found = await store.read("counter")
                revision, value = (0, 0) if found is None else (found.revision, int(found.body))
                try:
                    await store.write("counter", str(value + 1).encode(), expect=revision)
                    break
                except RevisionConflict:
                    await asyncio.sleep(0)

    await asyncio.gather(*(add_one(c) for c in clients for _ in range(2)))
    found = await h.store.read("counter")
    assert found is not None and int(found.body) == len(clients) * 2 * each == found.revision


async def test_a_deposed_holders_late_writes_are_fenced(h: Harness) -> None:
    a, b = h.store, h.client()
    old = await a.acquire("decider", "fe-a", h.short_ttl_s / 2)
    assert old is not None
    assert await a.write("served", b"from a", fence=old) == 1
    await h.eventually(lambda: _free(b, "decider"))
    with pytest.raises(Fenced) as nobody:  # expired, nobody holds it
        await a.write("served", b"late", fence=old)
    assert nobody.value.current is None
    new = await b.acquire("decider", "fe-b", LONG_TTL_S)
    assert new is not None
    with pytest.raises(Fenced) as deposed:
        await a.write("served", b"late", fence=old)
    assert deposed.value.grant == old
    assert deposed.value.current is not None
    assert (deposed.value.current.holder, deposed.value.current.epoch) == ("fe-b", new.epoch)
    with pytest.raises(Fenced):
        await a.delete("served", fence=old)
    found = await b.read("served")
    assert found is not None and (found.revision, found.body) == (1, b"from a")
    assert await b.write("served", b"from b", fence=new, expect=1) == 2
    await b.delete("served", fence=new)
    assert await a.read("served") is None


async def test_release_ends_only_the_current_grant(h: Harness) -> None:
    a, b = h.store, h.client()
    grant = await a.acquire("decider", "fe-a", LONG_TTL_S)
    assert grant is not None
    await a.release(grant)
    assert await b.holder("decider") is None
    stale = await a.acquire("decider", "fe-a", h.short_ttl_s / 2)
    assert stale is not None and stale.epoch == 2
    await h.eventually(lambda: _free(b, "decider"))
    taken = await b.acquire("decider", "fe-b", LONG_TTL_S)
    assert taken is not None and taken.epoch == 3
    await a.release(stale)  # a deposed holder's release leaves the new holder's grant alone
    current = await a.holder("decider")
    assert current is not None and (current.holder, current.epoch) == ("fe-b", 3)


async def test_watch_reports_every_document_written_or_deleted(h: Harness) -> None:
    names = await watching(h.client())
    try:
        s = h.store
        await s.write("served", b"1")
        assert await next_name(names) == "served"
        await s.write("load/a", b"x", ttl_s=LONG_TTL_S)
        assert await next_name(names) == "load/a"
        await s.delete("served")
        assert await next_name(names) == "served"
        await s.delete("never-written")  # nothing deleted, nothing reported
        with pytest.raises(RevisionConflict):  # nothing written, nothing reported
            await s.write("load/a", b"y", expect=0)
        await s.write("canary", b"2")
        assert await next_name(names) == "canary"
    finally:
        await names.aclose()  # type: ignore[attr-defined]


async def test_a_follower_applies_a_change_on_its_notification(h: Harness) -> None:
    """The periodic read is an hour away: only the store's notification can wake the follow loop."""
    clock = h.clock or MonotonicClock()
    follower = Follower(h.client(), clock, every_s=3600.0)
    seen: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def apply(found: Versioned | None) -> None:
        seen.put_nowait(None if found is None else found.body)

    follower.follow("served", apply)
    task = asyncio.create_task(follower.run())
    try:
        assert await asyncio.wait_for(seen.get(), EVENTUALLY_S) is None  # the read at start
        while True:  # written until the follower's watch, once open, reports it
            revision = await h.store.write("served", b"v2")
            try:
                body = await asyncio.wait_for(seen.get(), 0.2)
                break
            except TimeoutError:
                continue
        assert body == b"v2" and follower.applied["served"] == revision
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_redis_stopped_and_started_again_answers_again(redis_server: RedisServer) -> None:  # noqa: F811
    store = RedisStore(redis_server.url, timeout_s=1.0)
    try:
        assert await store.write("served", b"before") == 1
        names = await watching(store)
        redis_server.stop()
        with pytest.raises(StoreUnavailable):
            await store.read("served")
        with pytest.raises(StoreUnavailable):
            await next_name(names)
        redis_server.start()  # the same port, no persistence: the state is gone (docs/architecture.md 7b)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EVENTUALLY_S
        while True:
            try:
                assert await store.write("served", b"after") == 1
                break
            except StoreUnavailable:
                assert loop.time() < deadline
                await asyncio.sleep(0.05)
        names = await watching(store)
        await store.write("canary", b"x")
        assert await next_name(names) == "canary"
        await names.aclose()  # type: ignore[attr-defined]
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["local", "redis"])
@pytest.mark.parametrize("how", ["down", "hung"])
async def test_a_store_that_does_not_answer_is_unavailable(kind: str, how: str, tmp_path: Path) -> None:
    """Nobody at the address, or a listener that takes the connection and never answers."""
    hung: socket.socket | None = None
    store: Store
    if kind == "local":
        path = str(tmp_path / "store.sock")
        if how == "hung":
            hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            hung.bind(path)
            hung.listen(64)
        store = LocalStoreClient(path, "token", timeout_s=0.3)
    else:
        port = free_port()
        if how == "hung":
            hung = socket.create_server(("127.0.0.1", port), backlog=64)
        store = RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=0.3)
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: store.read("served"),
        lambda: store.read_prefix("load/"),
        lambda: store.write("served", b"x"),
        lambda: store.delete("served"),
        lambda: store.acquire("decider", "fe-a", 5.0),
        lambda: store.holder("decider"),
        lambda: anext(store.watch()),
    ]
    try:
        for call in calls:
            with pytest.raises(StoreUnavailable):
                await call()
    finally:
        await store.close()
        if hung is not None:
            hung.close()


async def test_scripts_flushed_from_redis_are_loaded_again(redis_server: RedisServer) -> None:  # noqa: F811
    import redis.asyncio as aioredis

    store = RedisStore(redis_server.url)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await store.write("served", b"1") == 1
        await admin.script_flush()
        assert await store.write("served", b"2", expect=1) == 2
        assert await store.acquire("decider", "fe-a", LONG_TTL_S) is not None
    finally:
        await admin.aclose()
        await store.close()


async def test_two_clusters_share_one_redis_apart(redis_server: RedisServer) -> None:  # noqa: F811
    blue, green = RedisStore(redis_server.url, name="blue"), RedisStore(redis_server.url, name="green")
    try:
        await blue.write("served", b"blue")
        assert await green.read("served") is None
        assert await green.read_prefix("") == {}
        grant = await blue.acquire("decider", "fe-a", LONG_TTL_S)
        other = await green.acquire("decider", "fe-b", LONG_TTL_S)
        assert grant is not None and other is not None and other.epoch == 1
    finally:
        await blue.close()
        await green.close()
