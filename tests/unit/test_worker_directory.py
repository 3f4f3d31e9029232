"""The server's one record of worker membership (runtime/membership.py `WorkerDirectory`): each served
model version's workers, taken by its runtime when it is built, written by the hub (a handshake counted
until it ends, however it ends), read per model version by fleet control, the admin API and the server,
and dropped with the version."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from inferd.clock import FakeClock
from inferd.config import ServerConfig
from inferd.errors import NotFound
from inferd.kinds.builtin import builtin_kinds
from inferd.kinds.llm.sim_llm import sim_llm_config
from inferd.kinds.upstream.runtime import openai_upstream_config
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.runtime.contract import Runtime
from inferd.runtime.hub import WorkerHub
from inferd.runtime.kinds import RuntimeContext
from inferd.runtime.membership import WorkerDirectory
from inferd.runtime.registry import ModelRegistry
from inferd.server import InferenceServer
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState
from tests.unit.test_llm_failover import RecordingWriter


def context(directory: WorkerDirectory) -> RuntimeContext:
    clock = directory.clock
    return RuntimeContext(ServerConfig(), clock, Metrics(), RetryBudget(clock), lambda w: None, directory)


def built(directory: WorkerDirectory, *configs: object) -> ModelRegistry:
    """A registry of runtimes built as the composition root builds them."""
    kinds, ctx, registry = builtin_kinds(), context(directory), ModelRegistry()
    for config in configs:
        registry.add(kinds.get(config.kind).make_runtime(config, ctx))  # type: ignore[attr-defined]
    return registry


def worker(name: str, model: str = "sim") -> WorkerConnection:
    return WorkerConnection(name, model, 1, "local", RecordingWriter())  # type: ignore[arg-type]


def ids(workers: object) -> list[str]:
    return [w.worker_id for w in workers]  # type: ignore[attr-defined]


async def started(waiter: asyncio.Future[None]) -> asyncio.Future[None]:
    await asyncio.sleep(0)
    assert not waiter.done()
    return waiter


async def test_each_runtime_with_workers_keeps_them_in_its_versions_membership() -> None:
    directory = WorkerDirectory(FakeClock())
    registry = built(directory, sim_config(), sim_config(version=2), sim_llm_config())
    v1, v2, llm = registry.get("sim", 1), registry.get("sim", 2), registry.get("sim-llm")
    assert v1.members is directory.members("sim", 1)  # type: ignore[attr-defined]
    assert v2.members is directory.members("sim", 2)  # type: ignore[attr-defined]
    assert llm.members is directory.members("sim-llm", 1)  # type: ignore[attr-defined]

    a, b, c = worker("sim-0.0"), worker("sim-1.0"), worker("sim-llm-0.0", "sim-llm")
    v1.add_worker(a)
    v1.add_worker(b)
    llm.add_worker(c)
    assert ids(directory.workers("sim", 1)) == ["sim-0.0", "sim-1.0"]
    assert directory.workers("sim", 2) == () and ids(directory.workers("sim-llm", 1)) == ["sim-llm-0.0"]
    assert directory.find("sim-1.0") == ("sim", 1, b) and directory.find("sim-llm-0.0") == ("sim-llm", 1, c)

    v1.drain_worker(a)  # draining: still listed, it holds work
    assert a.state is WorkerState.DRAINING and ids(directory.workers("sim", 1)) == ["sim-0.0", "sim-1.0"]
    assert directory.find("sim-0.0") == ("sim", 1, a)

    v1.on_worker_lost(a, "exit 0")
    assert ids(directory.workers("sim", 1)) == ["sim-1.0"] and a.state is WorkerState.DEAD
    with pytest.raises(NotFound, match=r"sim-0\.0"):
        directory.find("sim-0.0")
    assert set(directory.connections()) == {b, c}


async def test_a_wait_for_change_is_per_model_version() -> None:
    directory = WorkerDirectory(FakeClock())
    registry = built(directory, sim_config(), sim_config(version=2))
    waiter = await started(asyncio.ensure_future(directory.changed("sim", 1)))
    registry.get("sim", 2).add_worker(worker("sim-0.0"))
    await asyncio.sleep(0)
    assert not waiter.done()  # another version's arrival
    registry.get("sim", 1).add_worker(late := worker("sim-1.0"))
    await asyncio.wait_for(waiter, 1)

    waiter = await started(asyncio.ensure_future(directory.changed("sim", 1)))
    registry.get("sim", 1).on_worker_lost(late, "connection reset")
    await asyncio.wait_for(waiter, 1)


async def test_a_dropped_version_leaves_and_wakes_its_waiters_and_its_workers_are_still_closed() -> None:
    directory = WorkerDirectory(FakeClock())
    registry = built(directory, sim_config())
    rt = registry.get("sim", 1)
    straggler = worker("sim-0.0")
    rt.add_worker(straggler)
    waiter = await started(asyncio.ensure_future(directory.changed("sim", 1)))
    registry.remove("sim", 1)
    directory.drop("sim", 1)
    await asyncio.wait_for(waiter, 1)
    assert directory.workers("sim", 1) == ()
    with pytest.raises(NotFound, match="not served"):
        await directory.changed("sim", 1)
    assert directory.connections() == [straggler]  # still connected, drained: it exits (or joins again)
    assert straggler.state is WorkerState.DRAINING
    assert straggler.writer.sent[-1] == p.Drain(retired=True)  # type: ignore[attr-defined]  # its version went
    assert directory.members("sim", 1) is not rt.members  # type: ignore[attr-defined]  # served again: anew
    directory.drop("sim", 1)
    rt.on_worker_lost(straggler, "exit 0")
    assert directory.connections() == []
    directory.drop("sim", 1)  # not served: nothing to drop


def test_a_handshake_is_counted_until_it_ends_however_it_ends() -> None:
    directory = WorkerDirectory(FakeClock())
    conn = worker("sim-0.0")
    with directory.handshake(conn):
        assert directory.handshaking() == 1 and directory.connections() == [conn]
    assert directory.handshaking() == 0 and directory.connections() == []
    with pytest.raises(TimeoutError), directory.handshake(conn):
        raise TimeoutError  # it never said Ready
    assert directory.handshaking() == 0 and directory.connections() == []


async def test_a_model_without_workers_has_none() -> None:
    directory = WorkerDirectory(FakeClock())
    upstream = openai_upstream_config("big", {}, params={"upstreams": ["http://127.0.0.1:9/v1"]})
    rt = built(directory, upstream).get("big")
    assert not rt.accepts_workers and directory.workers("big", 1) == () and directory.connections() == []
    with pytest.raises(NotFound):
        await directory.changed("big", 1)


async def test_the_server_hands_its_directory_to_every_runtime_and_drops_a_removed_version() -> None:
    server = InferenceServer(ServerConfig(admin_port=None, workers=0), [sim_config()], spawn_workers=False)
    try:
        rt: Runtime = server.registry.get("sim")
        assert server.hub.directory is server.directory and server.fleet.directory is server.directory
        assert rt.members is server.directory.members("sim", 1)  # type: ignore[attr-defined]
        rt.add_worker(w := worker("sim-0.0"))
        assert server.directory.workers("sim", 1) == (w,)
        server.remove_version("sim", 1)
        assert server.directory.workers("sim", 1) == ()
    finally:  # never started: its socket folder is not removed on the way out
        shutil.rmtree(server._socket_dir, ignore_errors=True)


# ---- the hub writes it ----------------------------------------------------------------------------
async def join(path: Path, worker_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A worker of sim v1 that the hub welcomed: its handshake goes on."""
    reader, writer = await p.open_connection(f"unix:{path}", None)
    writer.write(p.encode_frame(p.Hello(worker_id=worker_id, model="sim", pid=1, host="h", version=1)))
    welcome = await asyncio.wait_for(p.read_message(reader), 30)
    assert isinstance(welcome, p.Welcome) and welcome.accepted, welcome
    return reader, writer


async def until(directory: WorkerDirectory, model: str, version: int, done: object) -> None:
    while not done():  # type: ignore[operator]
        await asyncio.wait_for(directory.changed(model, version), 30)


async def test_the_hub_counts_each_handshake_until_it_ends_however_it_ends(tmp_path: Path) -> None:
    clock = FakeClock()
    directory = WorkerDirectory(clock)
    registry = built(directory, sim_config(), sim_config(version=2))
    hub = WorkerHub(registry, clock, directory)
    path = tmp_path / "w.sock"
    await hub.listen_unix(str(path))
    try:
        reader, writer = await join(path, "sim-0.0")
        assert directory.handshaking() == 1 and len(directory.connections()) == 1
        writer.write(p.encode_frame(p.LoadFailed("out of memory")))  # could not load
        assert await asyncio.wait_for(reader.read(), 30) == b""  # released, then closed
        assert directory.handshaking() == 0 and hub.load_failures == {"sim": "out of memory"}
        writer.close()

        reader, writer = await join(path, "sim-0.1")
        writer.write(p.encode_frame(p.Drain()))  # anything but Ready breaks the handshake
        assert await asyncio.wait_for(reader.read(), 30) == b""
        assert directory.handshaking() == 0 and directory.connections() == []
        writer.close()

        reader, writer = await join(path, "sim-0.2")
        writer.write(p.encode_frame(p.Ready(1, 0.0, 0.0)))
        await until(directory, "sim", 1, lambda: directory.workers("sim", 1))
        (ready,) = directory.workers("sim", 1)
        assert ready.worker_id == "sim-0.2" and directory.handshaking() == 0
        assert directory.connections() == [ready]

        # its version stops being served while a worker of it loads: it joins, and is sent away
        old = registry.get("sim", 2).members  # type: ignore[attr-defined]
        late_reader, late_writer = await p.open_connection(f"unix:{path}", None)
        hello = p.Hello(worker_id="sim-1.0", model="sim", pid=2, host="h", version=2)
        late_writer.write(p.encode_frame(hello))
        welcome = await asyncio.wait_for(p.read_message(late_reader), 30)
        assert isinstance(welcome, p.Welcome) and welcome.accepted
        registry.remove("sim", 2)
        directory.drop("sim", 2)
        late_writer.write(p.encode_frame(p.Ready(2, 0.0, 0.0)))
        assert await asyncio.wait_for(late_reader.read(), 30) == b""
        while old.workers:
            await asyncio.wait_for(old.changed(), 30)
        assert directory.connections() == [ready] and directory.handshaking() == 0
        late_writer.close()
    finally:
        await hub.close()
    assert await asyncio.wait_for(reader.read(), 30) == b""  # closed at shutdown
    await until(directory, "sim", 1, lambda: not directory.workers("sim", 1))
    assert directory.connections() == []
    writer.close()


async def test_the_hub_turns_away_a_worker_of_a_model_without_workers(tmp_path: Path) -> None:
    clock = FakeClock()
    directory = WorkerDirectory(clock)
    upstream = openai_upstream_config("big", {}, params={"upstreams": ["http://127.0.0.1:9/v1"]})
    hub = WorkerHub(built(directory, upstream), clock, directory)
    path = tmp_path / "w.sock"
    await hub.listen_unix(str(path))
    try:
        reader, writer = await p.open_connection(f"unix:{path}", None)
        writer.write(p.encode_frame(p.Hello(worker_id="big-0.0", model="big", pid=1, host="h")))
        welcome = await asyncio.wait_for(p.read_message(reader), 30)
        assert isinstance(welcome, p.Welcome) and not welcome.accepted and "no workers" in welcome.reason
        assert directory.handshaking() == 0 and directory.connections() == []
        writer.close()
    finally:
        await hub.close()
