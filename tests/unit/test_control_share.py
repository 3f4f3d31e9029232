"""Model control with several front ends (fleet/control_share.py): the holder of the lease loads and
unloads, the other front end follows the served document (cluster/served.py), on a MemoryStore and a fake
clock; a load or unload asked of another front end is forwarded to the holder (api/repository.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inferd.api.repository import Order, Repository
from inferd.clock import FakeClock
from inferd.cluster.memory import MemoryStore
from inferd.cluster.served import SERVED, ServedState, ServedVersions
from inferd.config import ConfigError, ModelConfig, ServerConfig
from inferd.errors import ClusterUnavailable, Conflict, NotFound, WorkerUnavailable
from inferd.fleet.model_control import ModelControl, ModelState
from inferd.frontends.channel import PeerUnreachable
from inferd.kinds.repository import load_model_version, load_repository
from tests.unit.test_cluster_served import holding
from tests.unit.test_model_control import FakeRuntime, FakeServer, repo_of


@dataclass
class Front:
    server: FakeServer
    control: ModelControl
    versions: ServedVersions


def front(
    repo: Path, store: MemoryStore, clock: FakeClock, me: str, keeper: Any, loadable: bool = True, repository: bool = True
) -> Front:
    server = FakeServer()

    def load(model: str, version: int | None) -> ModelConfig:
        if not loadable:
            raise ConfigError(f"no model {model!r} in this front end's repository")
        return load_model_version(repo / model, version)

    moved: list[tuple[str, int, int]] = []
    server.fleet = SimpleNamespace(
        directory=SimpleNamespace(workers=lambda n, v: ()), updates=dict, load_version=load if repository else None, moved=moved,
        move_slots=lambda model, version, default: moved.append((model, version, default)),
    )
    control = ModelControl(server, ServerConfig(model_repo=repo))  # type: ignore[arg-type]
    for config in control.at_start_models(load_repository(repo)):
        server.add_version(config)
    versions = ServedVersions(store, me, server, clock, keeper, index=int(me))
    versions.control = control.share(versions)
    return Front(server, control, versions)


@contextlib.asynccontextmanager
async def two_fronts(tmp_path: Path, loadable: bool = True, repository: bool = True) -> AsyncIterator[tuple[Front, Front]]:
    """Front end 0 holds the lease, front end 1 follows; both serve the repository's a and b."""
    clock = FakeClock()
    store = MemoryStore(clock)
    repo = repo_of(tmp_path, "a", "b")
    holder = front(repo, store, clock, "0", await holding(store, clock))
    other = front(repo, store, clock, "1", None, loadable, repository)
    holder.versions.wait_s = 30.0  # a guard: a wait that missed the report fails the test here
    tasks = [asyncio.create_task(f.control.run()) for f in (holder, other)]
    await holder.versions.publish()
    await follow(other)
    try:
        yield holder, other
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def follow(f: Front) -> None:
    """One read of the follow loop (cluster/follower.py calls the applier so; it reports after)."""
    await f.versions.apply(await f.versions.store.read(SERVED.name))


async def until_done(task: asyncio.Future[None], other: Front) -> None:
    """The other front end follows (each read, a report) until the holder's `task` ends (bounded)."""
    for _ in range(500):
        if task.done():
            return await task
        await follow(other)
        await asyncio.sleep(0.01)
    raise AssertionError("the holder's load or unload did not end")


async def until_written(f: Front, written: Callable[[ServedState], bool]) -> None:
    """Until the served document says what `written` looks for (bounded)."""
    for _ in range(500):
        _, state = SERVED.decode(await f.versions.store.read(SERVED.name))
        if written(state):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the holder did not write the document")


def index(f: Front) -> dict[str, tuple[str, ModelState, str]]:
    return {r.name: (r.version, r.state, r.reason) for r in f.control.index(lambda name: True)}


async def test_an_unload_is_refused_everywhere_at_once_and_waits_for_the_others_work(tmp_path: Path) -> None:
    async with two_fronts(tmp_path) as (holder, other):
        busy = other.server.registry.get("a")
        busy.queued = 1  # type: ignore[attr-defined]  # a request of a held on front end 1
        unloading = asyncio.ensure_future(holder.control.unload("a"))
        await until_written(holder, lambda state: "a" in state.unloaded)  # then it waits for the reports
        await follow(other)
        with pytest.raises(NotFound, match="model 'a' is unloaded"):
            other.control.refuse_unloaded("a")  # its new requests: 404 there too, at once
        assert not unloading.done() and "a" in holder.server.registry  # front end 1 still holds a's work
        busy.queued = 0  # type: ignore[attr-defined]
        await until_done(unloading, other)
        assert "a" not in holder.server.registry
        await holder.versions.publish()  # (its loop writes every REPORT_EVERY_S)
        await follow(other)
        assert "a" not in other.server.registry and other.server.registry.names() == ["b"]
        assert other.server.fleet.moved == [("a", 1, 1)]  # its local workers there (many hosts): retired
        assert index(other) == index(holder) == {
            "a": ("", ModelState.UNAVAILABLE, "unloaded"), "b": ("1", ModelState.READY, "")
        }


async def test_a_load_is_served_by_every_front_end_before_it_answers(tmp_path: Path) -> None:
    async with two_fronts(tmp_path) as (holder, other):
        await until_done(asyncio.ensure_future(holder.control.unload("a")), other)
        await holder.versions.publish()
        await follow(other)
        loading = asyncio.ensure_future(holder.control.load("a"))
        await until_written(holder, lambda state: "a" in state.loading and "a" in state.models)  # it waits
        await follow(other)
        assert "a" in other.server.registry  # served there before its workers start (they join it too)
        with pytest.raises(WorkerUnavailable, match="model 'a' is loading"):
            other.control.refuse_unloaded("a")
        assert index(other)["a"] == ("", ModelState.LOADING, "loading")
        await until_done(loading, other)
        other.control.refuse_unloaded("a")  # answered everywhere once the load answered
        assert index(other) == index(holder) == {
            "a": ("1", ModelState.READY, ""), "b": ("1", ModelState.READY, "")
        }


async def test_a_load_a_front_end_cannot_serve_is_refused_409_and_nothing_stays_served(tmp_path: Path) -> None:
    async with two_fronts(tmp_path, loadable=False) as (holder, other):
        await until_done(asyncio.ensure_future(holder.control.unload("a")), other)
        await holder.versions.publish()
        await follow(other)
        holder.versions.wait_s = 0.2
        loading = asyncio.ensure_future(holder.control.load("a"))
        with pytest.raises(Conflict, match=r"front end\(s\) \[1\] do not serve version 1 of 'a'"):
            await until_done(loading, other)
        assert "a" not in holder.server.registry
        await holder.versions.publish()
        await follow(other)
        reason = index(other)["a"][2]
        assert index(holder)["a"] == ("", ModelState.UNAVAILABLE, reason) and reason.startswith("its last load failed")
        with pytest.raises(NotFound):
            other.control.refuse_unloaded("a")


async def test_a_front_end_that_does_not_hold_the_lease_refuses_load_and_unload(tmp_path: Path) -> None:
    async with two_fronts(tmp_path) as (holder, other):
        for act in (other.control.load, other.control.unload):
            with pytest.raises(ClusterUnavailable, match="does not decide for the server"):
                await act("a")
        for f in (holder, other):
            assert f.server.registry.names() == ["a", "b"] and not f.control.unloaded


class Channel:
    """The front ends' channel between two Repository objects: `to`'s answer, or unreachable."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}
        self.asked: list[str] = []
        self.reachable = True

    def handle(self, kind: str, handler: Any, timeout_s: float) -> None:
        self.handlers[kind] = handler

    async def ask_watched(self, to: str, kind: str, payload: bytes, timeout_s: float) -> bytes:
        self.asked.append(to)
        if not self.reachable:
            raise PeerUnreachable("connection refused")
        return await self.handlers[kind](payload)


async def test_a_load_or_unload_asked_elsewhere_is_forwarded_to_the_holder_with_its_answer(tmp_path: Path) -> None:
    async with two_fronts(tmp_path) as (holder, other):
        channel = Channel()  # one channel object: the holder's handler answers what front end 1 asks

        def view(f: Front, decider: str | None) -> Any:
            async def decider_id() -> str | None:
                return decider

            peers = SimpleNamespace(channel=channel, address=lambda to: f"unix:/frontend-{to}.sock")
            return SimpleNamespace(
                model_control=f.control, config=ServerConfig(), peers=peers, cluster=SimpleNamespace(decider_id=decider_id)
            )

        asking = Repository(view(other, "0"))
        Repository(view(holder, None))  # registered last: the holder answers what is asked on the channel
        unloading = asyncio.ensure_future(asking.carry_out(Order("unload", "a")))
        await until_done(unloading, other)
        assert channel.asked == ["unix:/frontend-0.sock"] and "a" not in holder.server.registry
        with pytest.raises(NotFound, match="unknown model 'c'"):  # the holder's error, as it answered it
            await asking.carry_out(Order("load", "c"))
        channel.reachable = False
        with pytest.raises(WorkerUnavailable, match="front end '0' loads and unloads models") as away:
            await asking.carry_out(Order("load", "a"))
        assert away.value.retry_after_s == 1.0


async def test_a_model_of_a_kind_the_document_does_not_list_is_never_dropped_as_unloaded(tmp_path: Path) -> None:
    """The document lists only the kinds that roll versions (a search index is followed otherwise): one
    named unloaded there is refused as the holder refuses it, never stopped here for its absence."""
    async with two_fronts(tmp_path) as (_, other):
        config = other.server.registry.get("a").config
        other.server.registry.add(FakeRuntime("idx", 1, config, kind="search"))  # type: ignore[arg-type]
        assert other.versions.control is not None
        other.versions.control.follow({"idx": "not loaded"}, [], ["a", "b"])
        assert "idx" in other.server.registry and other.control.unloaded["idx"] == "not loaded"
        other.versions.control.follow({"a": "unloaded"}, [], ["b"])  # a batch model: dropped as the holder did
        assert "a" not in other.server.registry


async def test_with_no_model_repository_a_front_end_serves_again_what_it_started_with(tmp_path: Path) -> None:
    """`inferd serve --model sim --frontends 2`: no repository to load from; the others serve again the
    version they started with."""
    async with two_fronts(tmp_path, repository=False) as (holder, other):
        await until_done(asyncio.ensure_future(holder.control.unload("a")), other)
        await holder.versions.publish()
        await follow(other)
        assert "a" not in other.server.registry
        await until_done(asyncio.ensure_future(holder.control.load("a")), other)
        assert other.server.registry.versions("a") == [1] and index(other)["a"] == ("1", ModelState.READY, "")
