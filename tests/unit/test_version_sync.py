"""Model versions with several front ends (frontends/version_sync.py): what the owner's rolling update
waits for, and what a follower serves."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from inferd.clock import FakeClock
from inferd.config import ConfigError
from inferd.errors import Conflict
from inferd.frontends.followers import LIVE_S
from inferd.frontends.plan import FrontendPlan
from inferd.frontends.version_sync import Answer, FollowerVersions, Report, Served, VersionSync
from inferd.kinds.builtin import builtin_kinds
from inferd.runtime.hub import WorkerHub
from inferd.runtime.membership import WorkerDirectory
from inferd.runtime.registry import ModelRegistry
from inferd.wire import protocol as p


def test_an_update_waits_only_for_the_followers_up_that_lack_the_new_version() -> None:
    clock = FakeClock()
    followers = FollowerVersions(clock, live_s=2.0)
    assert followers.not_serving("sim", 2) == []  # no follower heard of: nobody to wait for
    followers.report(1, {"sim": Served([1], 1)})
    followers.report(2, {"sim": Served([1, 2], 1)})
    assert followers.not_serving("sim", 2) == [1]
    clock.advance(2.5)  # silent since: down (it asks the owner before it serves again)
    followers.report(2, {"sim": Served([1, 2], 1)})
    assert followers.not_serving("sim", 2) == []


def test_the_last_old_worker_waits_for_followers_that_moved_and_hold_no_old_work() -> None:
    followers = FollowerVersions(FakeClock())
    followers.report(1, {"sim": Served([1, 2], 1)})
    assert followers.not_moved("sim", 1, 2) == [1]  # its default is the old version still
    followers.report(1, {"sim": Served([1, 2], 2, busy=[1])})
    assert followers.not_moved("sim", 1, 2) == [1]  # requests queued on the old version
    followers.report(1, {"sim": Served([1, 2], 2, busy=[2])})
    assert followers.not_moved("sim", 1, 2) == []


class Server:
    """What VersionSync uses of the composition root, over a real registry of runtimes that only hold
    a config and their statistics."""

    def __init__(self, versions: list[int], loadable: set[int]) -> None:
        self.registry = ModelRegistry()
        self.loadable = loadable
        self.busy: set[int] = set()
        self.fleet = SimpleNamespace(load_version=self.load)
        self.hub = SimpleNamespace(before_refusal=None)
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


def owner_and_follower(owner: Server, follower: Server) -> tuple[VersionSync, VersionSync]:
    """Two front ends whose channel is a direct call of the owner's handler."""
    handlers = {}
    channel = SimpleNamespace(
        handle=lambda kind, handler, timeout_s: handlers.setdefault(kind, handler),
        ask=lambda kind, payload, timeout_s: handlers[kind](payload),
    )
    clock = FakeClock()
    first = VersionSync(FrontendPlan(0, 2, "/nonexistent", "t"), channel, owner, clock)  # type: ignore[arg-type]
    other = VersionSync(FrontendPlan(1, 2, "/nonexistent", "t"), channel, follower, clock)  # type: ignore[arg-type]
    return first, other


async def test_a_follower_serves_the_new_version_takes_the_default_then_retires_the_old() -> None:
    owner, follower = Server([1], {1, 2}), Server([1], {1, 2})
    first, other = owner_and_follower(owner, follower)
    owner.add_version(owner.load("sim", 2))
    owner.registry.set_default("sim", 1)  # an update pins the old default until a new worker is ready
    await other.open()
    assert follower.hub.before_refusal == other.exchange
    assert follower.registry.versions("sim") == [1, 2] and follower.registry.default_version("sim") == 1
    await other.exchange()  # its report now says so
    await first.until_serving("sim", 2)
    owner.registry.set_default("sim", 2)
    follower.busy = {1}
    moved = asyncio.create_task(first.until_moved("sim", 1, 2))
    await other.exchange()  # it moves, but holds work of version 1 still
    assert follower.registry.default_version("sim") == 2 and not moved.done()
    follower.busy = set()
    await other.exchange()
    await asyncio.wait_for(moved, 30)  # a guard: a wait that missed the report fails here
    owner.remove_version("sim", 1)
    await other.exchange()
    assert follower.registry.versions("sim") == [2]


async def test_an_update_is_refused_while_a_follower_cannot_load_the_new_version() -> None:
    owner, follower = Server([1], {1, 2}), Server([1], {1})  # its repository lacks version 2
    first, other = owner_and_follower(owner, follower)
    first.wait_s = 0.05
    owner.add_version(owner.load("sim", 2))
    owner.registry.set_default("sim", 2)
    owner.remove_version("sim", 1)
    await other.exchange()
    await other.exchange()
    assert follower.registry.versions("sim") == [1]  # it keeps what it can serve
    with pytest.raises(Conflict, match=r"front end\(s\) \[1\] do not serve version 2"):
        await first.until_serving("sim", 2)


async def test_a_restarted_follower_serves_an_older_version_the_owner_went_back_to() -> None:
    owner, follower = Server([1], {1, 2}), Server([2], {1, 2})
    _, other = owner_and_follower(owner, follower)
    await other.open()
    assert follower.registry.versions("sim") == [1] and follower.registry.default_version("sim") == 1


async def test_the_owner_answers_with_what_it_serves() -> None:
    owner = Server([1], {1, 2})
    first, _ = owner_and_follower(owner, Server([1], {1}))
    raw = await first._answer(msgspec.msgpack.encode(Report(1, {"sim": Served([1], 1)})))
    assert msgspec.msgpack.decode(raw, type=Answer) == Answer({"sim": Served([1], 1)})


def batch_runtime(version: int) -> SimpleNamespace:
    config = SimpleNamespace(default_version=None, model_dump_json=lambda: "{}")
    return SimpleNamespace(name="sim", version=version, kind="batch", config=config, accepts_workers=True)


async def welcome_of(address: str, version: int) -> p.Welcome:
    reader, writer = await p.open_connection(address, None)
    writer.write(p.encode_frame(p.Hello(worker_id="sim-2.0", model="sim", pid=1, host="h", version=version)))
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

    async def learn() -> None:  # the owner serves version 2 by now
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
    finally:
        await hub.close()


async def test_an_update_does_not_wait_for_a_follower_that_died() -> None:
    """It reported (version 1 only) and died: once its report is stale the update goes on, although no
    report comes to say so (before, it waited the whole wait_s and answered 409 naming nobody)."""
    owner, follower = Server([1], {1, 2}), Server([1], {1, 2})
    first, other = owner_and_follower(owner, follower)
    await other.exchange()
    owner.add_version(owner.load("sim", 2))
    waiting = asyncio.create_task(first.until_serving("sim", 2))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    first.clock.advance(LIVE_S + 0.1)  # (the followers' record runs on the same clock)
    await asyncio.wait_for(waiting, 5)  # no Conflict, and well within wait_s


class Broken(Server):
    """A repository whose version 2 fails in the model's own code (not a config error)."""

    loads = 0

    def load(self, model: str, version: int | None) -> SimpleNamespace:
        if version == 2:
            self.loads += 1
            raise RuntimeError("the new version's tokenizer failed")
        return super().load(model, version)


async def test_a_version_failing_in_the_models_own_code_is_logged_and_not_retried_every_tick() -> None:
    owner, follower = Server([1], {1, 2}), Broken([1], {1, 2})
    first, other = owner_and_follower(owner, follower)
    owner.add_version(owner.load("sim", 2))
    for _ in range(3):
        assert await other.exchange()  # the follower goes on serving version 1
    assert follower.registry.versions("sim") == [1] and follower.loads == 1
    first.clock.advance(30.0)
    await other.exchange()
    assert follower.loads == 2  # tried again later
