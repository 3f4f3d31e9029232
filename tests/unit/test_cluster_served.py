"""Which versions are served where (cluster/served.py), on a MemoryStore and a fake clock: what the
holder's rolling update waits for, what every other front end serves, and what the lease allows."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from inferd.clock import FakeClock
from inferd.cluster.lease import LeaseKeeper
from inferd.cluster.memory import MemoryStore
from inferd.cluster.served import (
    REPORT_TTL_S,
    SERVED,
    SERVING,
    ModelServed,
    Served,
    ServedState,
    ServedVersions,
    Serving,
    names,
    serving_reports,
)
from inferd.cluster.store import Fenced, StoreUnavailable
from inferd.config import ConfigError
from inferd.errors import ClusterUnavailable, Conflict
from inferd.kinds.builtin import builtin_kinds
from inferd.runtime.hub import WorkerHub
from inferd.runtime.membership import WorkerDirectory
from inferd.runtime.registry import ModelRegistry
from inferd.wire import protocol as p


class Server:
    """What ServedVersions uses of the composition root, over a real registry of runtimes that only
    hold a config and their statistics."""

    def __init__(self, versions: list[int], loadable: set[int]) -> None:
        self.registry = ModelRegistry()
        self.loadable = loadable
        self.busy: set[int] = set()
        self.updating: dict[str, tuple[int, int, int]] = {}
        self.moved: list[tuple[str, int, int]] = []
        """(model, version, default): the local slots of a version no longer served moved to the default."""
        self.fleet = SimpleNamespace(
            load_version=self.load, updates=lambda: dict(self.updating),
            move_slots=lambda model, version, default: self.moved.append((model, version, default)),
        )
        self.kinds = builtin_kinds()
        for v in versions:
            self.add_version(self.load("sim", v))

    def load(self, model: str, version: int | None) -> SimpleNamespace:
        if version not in self.loadable:
            raise ConfigError(f"no version {version} in the repository")
        return SimpleNamespace(name=model, version=version, kind="batch", default_version=None)

    def add_version(self, config: SimpleNamespace) -> None:
        stats = lambda: SimpleNamespace(queued=int(config.version in self.busy), in_flight=0)  # noqa: E731
        runtime = SimpleNamespace(
            name=config.name, version=config.version, kind=config.kind, config=config, statistics=stats
        )
        self.registry.add(runtime)  # type: ignore[arg-type]

    def remove_version(self, name: str, version: int) -> None:
        self.registry.remove(name, version)


async def holding(store: MemoryStore, clock: FakeClock, me: str = "0") -> LeaseKeeper:
    keeper = LeaseKeeper(me, clock)
    keeper.granted(clock.now(), await store.acquire(keeper.lease, me, keeper.ttl_s))
    return keeper


async def holder_and_other(
    holder: Server, other: Server, clock: FakeClock | None = None
) -> tuple[ServedVersions, ServedVersions, MemoryStore]:
    """Front end 0 holds the lease; front end 1 follows; one store."""
    clock = clock or FakeClock()
    store = MemoryStore(clock)
    first = ServedVersions(store, "0", holder, clock, await holding(store, clock), index=0)
    second = ServedVersions(store, "1", other, clock, None, index=1)
    first.wait_s = 0.05
    return first, second, store


async def follow(versions: ServedVersions) -> None:
    """One read of the follow loop (cluster/follower.py calls the applier so)."""
    await versions.apply(await versions.store.read(SERVED.name))


async def test_an_update_waits_only_for_the_front_ends_up_that_lack_the_new_version() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    lacking = lambda r: 2 not in r.of("sim").versions  # noqa: E731
    reports = serving_reports(store, "0")
    assert names(await reports.until(lacking, 0.05)) == []  # no front end heard of: nobody to wait for
    for index, versions in ((1, [1]), (2, [1, 2])):
        report = Serving(str(index), index, {"sim": Served(versions, 1)})
        await store.write(SERVING + str(index), msgspec.msgpack.encode(report), ttl_s=REPORT_TTL_S)
    assert names(await reports.until(lacking, 0.05)) == [1]
    clock.advance(REPORT_TTL_S + 0.5)  # front end 1 silent since: its report expired (it reads first if back)
    assert names(await reports.until(lacking, 0.05)) == []


async def test_a_front_end_serves_the_new_version_takes_the_default_then_retires_the_old() -> None:
    holder, other = Server([1], {1, 2}), Server([1], {1, 2})
    first, second, _ = await holder_and_other(holder, other)
    holder.add_version(holder.load("sim", 2))
    holder.registry.set_default("sim", 1)  # an update pins the old default until a new worker is ready
    holder.updating["sim"] = (1, 2, 1)
    first.wait_s = 30.0  # a guard: a wait that missed the report fails here
    serving = asyncio.create_task(first.until_serving("sim", 2))  # writes the document, then waits
    await asyncio.sleep(0.05)
    await follow(second)  # serves version 2 and reports it
    await asyncio.wait_for(serving, 30)
    assert other.registry.versions("sim") == [1, 2] and other.registry.default_version("sim") == 1
    assert first.state.models["sim"] == ModelServed([1, 2], 1, [1, 2, 1])
    holder.registry.set_default("sim", 2)
    other.busy = {1}
    moved = asyncio.create_task(first.until_moved("sim", 1, 2))
    await asyncio.sleep(0.05)
    await follow(second)  # it moves, but holds work of version 1 still
    await asyncio.sleep(0.2)
    assert other.registry.default_version("sim") == 2 and not moved.done()
    other.busy = set()
    await second.report()
    await asyncio.wait_for(moved, 30)
    holder.remove_version("sim", 1)
    del holder.updating["sim"]
    await first.publish()
    await follow(second)
    assert other.registry.versions("sim") == [2]
    assert other.moved == [("sim", 1, 2)] and holder.moved == []  # its local workers follow the default


async def test_an_update_is_refused_while_a_front_end_cannot_load_the_new_version() -> None:
    holder, other = Server([1], {1, 2}), Server([1], {1})  # its repository lacks version 2
    first, second, _ = await holder_and_other(holder, other)
    holder.add_version(holder.load("sim", 2))
    holder.registry.set_default("sim", 2)
    holder.remove_version("sim", 1)
    await first.publish()
    await follow(second)
    await follow(second)
    assert other.registry.versions("sim") == [1]  # it keeps what it can serve
    with pytest.raises(Conflict, match=r"front end\(s\) \[1\] do not serve version 2"):
        await first.until_serving("sim", 2)


async def test_a_restarted_front_end_serves_an_older_version_the_holder_went_back_to() -> None:
    holder, other = Server([1], {1, 2}), Server([2], {1, 2})
    first, second, _ = await holder_and_other(holder, other)
    await first.publish()
    await follow(second)
    assert other.registry.versions("sim") == [1] and other.registry.default_version("sim") == 1


async def test_the_holder_writes_what_it_serves_and_does_not_follow_the_document() -> None:
    holder = Server([1], {1, 2})
    first, _, store = await holder_and_other(holder, Server([1], {1}))
    await first.publish()
    revision, state = await SERVED.read(store)
    assert state.models == {"sim": ModelServed([1], 1, [])} and revision == 1
    await first.publish()
    assert (await SERVED.read(store))[0] == 1  # unchanged: not written again
    holder.add_version(holder.load("sim", 2))  # its update's new version, not written yet
    await store.write(SERVED.name, SERVED.encode(ServedState(generation=3)))  # a reload elsewhere
    await follow(first)
    assert holder.registry.versions("sim") == [1, 2]  # the holder's own registry is what it writes


async def test_a_deposed_holders_late_write_is_refused_and_its_update_answers_503() -> None:
    clock = FakeClock()
    holder = Server([1], {1, 2})
    first, _, store = await holder_and_other(holder, Server([1], {1, 2}), clock)
    grant = first.keeper.grant() if first.keeper else None
    assert grant is not None
    clock.advance(6.0)  # its lease expired; another front end takes it (epoch 2)
    assert (await store.acquire("decider", "1", 5.0)).epoch == 2  # type: ignore[union-attr]
    with pytest.raises(Fenced):
        await SERVED.update(store, lambda s: ServedState(generation=9), fence=grant)
    assert first.keeper is not None and first.keeper.grant() is None  # it knows, too: it stopped acting
    await first.publish()  # writes nothing without the lease
    assert (await SERVED.read(store))[0] == 0
    with pytest.raises(ClusterUnavailable, match="does not hold the lease"):
        await first.until_serving("sim", 2)


async def test_an_update_answers_503_naming_the_store_when_it_does_not_answer() -> None:
    class Down(MemoryStore):
        async def read(self, doc: str) -> None:
            raise StoreUnavailable("no answer within 2 s")

    clock = FakeClock()
    store = Down(clock)
    holder = Server([1], {1, 2})
    first = ServedVersions(store, "0", holder, clock, await holding(store, clock), index=0)
    with pytest.raises(ClusterUnavailable, match="the cluster store does not answer"):
        await first.until_serving("sim", 2)


async def test_a_new_holder_ends_an_update_the_last_one_left_where_its_default_was() -> None:
    for default, kept in ((2, [2]), (1, [1])):  # past its first new worker: finished; before: undone
        clock = FakeClock()
        store = MemoryStore(clock)
        other = Server([1, 2], {1, 2})
        other.registry.set_default("sim", default)
        await store.write(SERVED.name, SERVED.encode(ServedState(models={"sim": ModelServed([1, 2], default, [1, 2, 2])})))
        versions = ServedVersions(store, "1", other, clock, LeaseKeeper("1", clock), index=1)
        await follow(versions)  # not holding: it serves both, as the document says
        assert versions.keeper is not None
        versions.keeper.granted(clock.now(), await store.acquire("decider", "1", 5.0))  # the holder died
        await versions.publish()
        assert other.registry.versions("sim") == kept and other.registry.default_version("sim") == default
        assert other.moved == [("sim", 3 - default, default)]
        assert (await SERVED.read(store))[1].models["sim"] == ModelServed(kept, default, [])


async def test_an_update_does_not_wait_for_a_front_end_that_died() -> None:
    """It reported (version 1 only) and died: once its report expires the update goes on, although no
    report comes to say so."""
    clock = FakeClock()
    holder, other = Server([1], {1, 2}), Server([1], {1, 2})
    first, second, _ = await holder_and_other(holder, other, clock)
    first.wait_s = 30.0
    await second.report()
    holder.add_version(holder.load("sim", 2))
    waiting = asyncio.create_task(first.until_serving("sim", 2))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    clock.advance(REPORT_TTL_S + 0.1)  # (the store's ttl runs on the same clock)
    await asyncio.wait_for(waiting, 5)  # no Conflict, and well within wait_s


class Broken(Server):
    """A repository whose version 2 fails in the model's own code (not a config error)."""

    loads = 0

    def load(self, model: str, version: int | None) -> SimpleNamespace:
        if version == 2:
            self.loads += 1
            raise RuntimeError("the new version's tokenizer failed")
        return super().load(model, version)


async def test_a_version_failing_in_the_models_own_code_is_logged_and_not_retried_every_read() -> None:
    clock = FakeClock()
    holder, other = Server([1], {1, 2}), Broken([1], {1, 2})
    first, second, store = await holder_and_other(holder, other, clock)
    holder.add_version(holder.load("sim", 2))
    await first.publish()
    for generation in range(3):  # the document moves (a reload, say): each read applies it again
        await store.write(SERVED.name, SERVED.encode(msgspec.structs.replace(first.state, generation=generation)))
        await follow(second)  # it goes on serving version 1
    assert other.registry.versions("sim") == [1] and other.loads == 1
    clock.advance(30.0)
    await follow(second)
    assert other.loads == 2  # tried again later


def batch_runtime(version: int) -> SimpleNamespace:
    config = SimpleNamespace(default_version=None, pool=None, model_dump_json=lambda: "{}")
    return SimpleNamespace(name="sim", version=version, kind="batch", config=config, accepts_workers=True)


async def welcome_of(address: str, version: int, token: str = "") -> p.Welcome:
    reader, writer = await p.open_connection(address, None)
    hello = p.Hello(worker_id="sim-2.0", model="sim", pid=1, host="h", version=version, token=token)
    writer.write(p.encode_frame(hello))
    try:
        welcome = await asyncio.wait_for(p.read_message(reader), 30)
    finally:
        writer.close()
    assert isinstance(welcome, p.Welcome)
    return welcome


async def test_a_hub_asks_once_more_before_it_turns_away_a_worker_of_a_version_not_served(
    tmp_path: Path,
) -> None:
    registry = ModelRegistry()
    registry.add(batch_runtime(1))  # type: ignore[arg-type]
    clock = FakeClock()
    hub = WorkerHub(registry, clock, WorkerDirectory(clock))
    asked: list[int] = []

    async def learn() -> None:  # the holder serves version 2 by now
        asked.append(len(asked))
        if 2 not in registry.versions("sim"):
            registry.add(batch_runtime(2))  # type: ignore[arg-type]

    hub.before_refusal = learn
    await hub.listen_unix(str(tmp_path / "w.sock"))
    try:
        address = f"unix:{tmp_path / 'w.sock'}"
        assert (await welcome_of(address, 1)).accepted and asked == []  # served: nobody asked
        assert (await welcome_of(address, 2)).accepted and asked == [0]
        refused = await welcome_of(address, 3)  # still not served once asked: turned away
        assert not refused.accepted and "served versions: [1, 2]" in refused.reason and asked == [0, 1]
        assert "version 3 of model 'sim'" in refused.reason and "default version (2)" in refused.reason
    finally:
        await hub.close()


async def test_a_worker_with_a_bad_token_never_makes_the_hub_read_the_store(tmp_path: Path) -> None:
    registry = ModelRegistry()
    registry.add(batch_runtime(1))  # type: ignore[arg-type]
    clock = FakeClock()
    hub = WorkerHub(registry, clock, WorkerDirectory(clock), tokens=("secret",))
    asked: list[int] = []

    async def learn() -> None:
        asked.append(len(asked))

    hub.before_refusal = learn
    await hub.listen_unix(str(tmp_path / "w.sock"))
    try:
        address = f"unix:{tmp_path / 'w.sock'}"
        refused = await welcome_of(address, 2, token="guess")
        assert not refused.accepted and refused.reason == "bad join token" and asked == []
        assert not (await welcome_of(address, 2, token="secret")).accepted and asked == [0]  # a real worker: asked
    finally:
        await hub.close()


async def test_the_holder_refuses_a_change_while_the_store_does_not_answer_its_reads() -> None:
    """Within its lease time a holder still holds the lease when the store stops answering; a change
    made then could not be shared, so it is refused as soon as the follow loop's read failed."""
    first, _, _ = await holder_and_other(Server([1], {1}), Server([1], {1}))
    up = True
    first.store_up = lambda: up
    first.check_holder()  # holds the lease, the store answers: the change goes ahead
    up = False
    with pytest.raises(ClusterUnavailable, match="cluster store did not answer"):
        first.check_holder()
    assert first.holds()  # it holds the lease still: only changes wait for the store


async def test_a_new_holder_serves_the_documents_versions_before_it_writes_its_own() -> None:
    """A front end that just joined (its config serves version 1) takes the lease of a server that had
    rolled to version 2: it serves version 2 as the default, and the document keeps saying so."""
    clock = FakeClock()
    store = MemoryStore(clock)
    await store.write(SERVED.name, SERVED.encode(ServedState(models={"sim": ModelServed([2], 2, [])})))
    joined = Server([1], {1, 2})
    versions = ServedVersions(store, "new", joined, clock, await holding(store, clock, "new"), index=-1)
    await versions.publish()
    _, state = await SERVED.read(store)
    assert state.models["sim"] == ModelServed([2], 2, [])
    assert joined.registry.versions("sim") == [2] and joined.registry.default_version("sim") == 2
