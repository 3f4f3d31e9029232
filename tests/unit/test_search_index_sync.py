"""Search indexes created or deleted through the API with several front ends (frontends/index_sync.py): what
the owner waits for, and what a follower serves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from inferd.clock import FakeClock
from inferd.config import ModelConfig
from inferd.frontends import index_sync
from inferd.frontends.index_sync import FollowerIndexes, Indexes, IndexSync, Report
from inferd.frontends.plan import FrontendPlan
from inferd.kinds.search.config import params_of
from inferd.kinds.search.kind import search_kind
from inferd.runtime.kinds import KindRegistry


# ---- indexes created or deleted while the server runs -------------------------------------------------
def test_a_new_index_waits_only_for_the_followers_up_that_do_not_serve_it() -> None:
    clock = FakeClock()
    reports = FollowerIndexes(clock, live_s=2.0)
    assert reports.missing("notes") == []  # no follower heard of: nobody to wait for
    reports.report(1, ["docs"])
    reports.report(2, ["docs", "notes"])
    assert reports.missing("notes") == [1]
    clock.advance(1.0)
    reports.report(1, ["docs", "notes"])
    assert reports.missing("notes") == []
    reports.report(2, ["docs"])  # it has not caught up with a delete and a new create yet
    assert reports.missing("notes") == [2]
    clock.advance(2.5)  # silent since: down (it serves data_dir's indexes when it starts again)
    assert reports.missing("notes") == []


def test_a_deleted_index_waits_for_the_followers_up_that_still_serve_it() -> None:
    clock = FakeClock()
    reports = FollowerIndexes(clock, live_s=2.0)
    reports.report(1, ["docs", "notes"])
    reports.report(2, ["docs"])
    assert reports.still_serving("notes") == [1]
    reports.report(1, ["docs"])
    assert reports.still_serving("notes") == []


class Registry:
    """The few ModelRegistry calls IndexSync makes, over search runtimes that hold only a config."""

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

    def add_version(self, config: ModelConfig) -> None:
        self.registry.served[config.name] = SimpleNamespace(config=config, version=config.version)
        self.added.append((config.name, params_of(config).shards))

    def remove_version(self, name: str, version: int) -> None:
        del self.registry.served[name]


class Owner:
    """The owner's answers to a follower's exchanges: the indexes it serves when asked. The first answer
    can be held back (a slow exchange that a later one overtakes)."""

    def __init__(self, settings: dict[str, dict[str, object]]) -> None:
        self.settings = settings
        self.hold_first = asyncio.Event()
        self.first_asked = asyncio.Event()
        self.asked = 0

    async def ask(self, kind: str, payload: bytes, timeout_s: float) -> bytes:
        self.asked += 1
        answer = msgspec.msgpack.encode(Indexes(dict(self.settings)))
        if self.asked == 1:
            self.first_asked.set()
            await self.hold_first.wait()
        return answer


def follower_sync(owner: Owner, server: Server) -> IndexSync:
    channel = SimpleNamespace(ask=owner.ask)
    return IndexSync(FrontendPlan(1, 2, "/nonexistent", "t"), channel, server, FakeClock())  # type: ignore[arg-type]


async def test_an_answer_overtaken_by_a_newer_one_does_not_bring_back_a_deleted_index() -> None:
    owner, server = Owner({"notes": {"shards": 1}}), Server()
    sync = follower_sync(owner, server)
    first = asyncio.create_task(sync.exchange())  # asked while "notes" was there; its answer is slow
    await owner.first_asked.wait()
    owner.settings = {}  # deleted meanwhile
    second = asyncio.create_task(sync.exchange())
    await asyncio.sleep(0)  # one turn of the loop: the second exchange asks, if nothing holds it back
    owner.hold_first.set()
    assert await asyncio.gather(first, second) == [True, True]
    assert server.registry.names() == []  # the newer answer is the last word


async def test_an_index_created_again_with_other_settings_is_served_anew() -> None:
    owner, server = Owner({"notes": {"shards": 1}}), Server()
    owner.hold_first.set()
    sync = follower_sync(owner, server)
    assert await sync.exchange()
    owner.settings = {"notes": {"shards": 2}}  # deleted and created again between two exchanges
    assert await sync.exchange()
    assert server.added == [("notes", 1), ("notes", 2)]
    assert params_of(server.registry.get("notes").config).shards == 2


async def test_the_owner_answers_a_delete_once_the_followers_dropped_the_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(index_sync, "FOLLOWERS_WAIT_S", 3600.0)  # only the report can end the wait
    server = Server()
    channel = SimpleNamespace(handle=lambda kind, handler, timeout_s: None)
    sync = IndexSync(FrontendPlan(0, 2, "/nonexistent", "t"), channel, server, FakeClock())  # type: ignore[arg-type]
    await sync._answer(msgspec.msgpack.encode(Report(1, ["notes"])))
    deleted = asyncio.create_task(sync.until_followers_drop("notes"))
    await asyncio.sleep(0)  # it waits
    await sync._answer(msgspec.msgpack.encode(Report(1, ["notes"])))  # not yet
    await asyncio.sleep(0)
    assert not deleted.done()
    await sync._answer(msgspec.msgpack.encode(Report(1, [])))
    await asyncio.wait_for(deleted, 30)  # a guard: a wait that missed the report fails here
