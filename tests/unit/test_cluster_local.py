"""The parent's store of `--frontends N` (cluster/local.py): served from a thread, reached from other
processes over its Unix socket, refusing a request without the plan's token, keeping its state when its
loop fails and starts again, and answered StoreUnavailable once it is gone. The semantics themselves are
the conformance tests' (test_cluster_store.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferd.clock import MonotonicClock
from inferd.cluster import local
from inferd.cluster.local import LocalStoreClient, LocalStoreServer
from inferd.cluster.store import StoreError, StoreUnavailable
from inferd.frontends.plan import FrontendPlan
from tests.conftest import ROOT

TOKEN = "t0ken"

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from inferd.cluster.local import LocalStoreClient

    async def main(path, token):
        store = LocalStoreClient(path, token)
        names = store.watch()
        first = asyncio.ensure_future(anext(names))
        while not first.done():  # written until the watch, once open, reports it
            await store.write("child/ready", b"1")
            await asyncio.wait([first], timeout=0.05)
        assert first.result() == "child/ready"
        print("watching", flush=True)
        async for name in names:
            if name == "go":
                break
        found = await store.read("go")
        await store.write("reply", found.body + b"!", expect=0)
        await names.aclose()
        await store.close()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalStoreServer]:
    plan = FrontendPlan(0, 2, str(tmp_path), TOKEN)
    served = LocalStoreServer(plan.store_path(), TOKEN, MonotonicClock())
    served.start()
    try:
        yield served
    finally:
        served.stop()


async def test_a_front_end_in_another_process_reads_writes_and_watches(server: LocalStoreServer) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, server.path, TOKEN, stdout=subprocess.PIPE, env=env
    )
    store = LocalStoreClient(server.path, TOKEN)
    try:
        assert child.stdout is not None
        assert await asyncio.wait_for(child.stdout.readline(), 30) == b"watching\n"
        assert await store.write("go", b"hello") == 1
        assert await asyncio.wait_for(child.wait(), 30) == 0
        found = await store.read("reply")
        assert found is not None and found.body == b"hello!" and found.revision == 1
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        await store.close()


async def test_a_request_without_the_plans_token_is_refused(server: LocalStoreServer) -> None:
    intruder = LocalStoreClient(server.path, "guess")
    with pytest.raises(StoreError, match="token"):
        await intruder.write("served", b"mine")
    with pytest.raises(StoreError, match="token"):
        await anext(intruder.watch())
    await intruder.close()
    assert server.state.read("served") is None


async def test_the_state_outlives_a_failure_of_the_servers_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = asyncio.start_unix_server
    calls = []

    async def fails_once(*args: object, **kwargs: object) -> asyncio.Server:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("injected")
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(local.asyncio, "start_unix_server", fails_once)
    served = LocalStoreServer(str(tmp_path / "store.sock"), TOKEN, MonotonicClock())
    served.state.write("served", b"v3")
    served.start()
    store = LocalStoreClient(served.path, TOKEN)
    try:
        for _ in range(200):  # the first start failed; the next one comes RESTART_DELAY_S later
            try:
                found = await store.read("served")
                break
            except StoreUnavailable:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("the store server did not start again")
        assert found is not None and found.body == b"v3"
        assert served.failures == 1
    finally:
        await store.close()
        served.stop()


async def test_a_store_gone_is_unavailable_to_calls_and_watchers(
    server: LocalStoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStoreClient(server.path, TOKEN, timeout_s=1.0)
    names = store.watch()
    first = asyncio.ensure_future(anext(names))
    while not first.done():  # written until the watch, once open, reports it
        await store.write("a", b"1")
        await asyncio.wait([first], timeout=0.05)
    assert first.result() == "a"
    with caplog.at_level(logging.ERROR):
        await asyncio.to_thread(server.stop)  # with a watch and a pooled connection open
    assert not caplog.records  # its connections ended cleanly, none cancelled mid-read
    with pytest.raises(StoreUnavailable):
        await anext(names)
    with pytest.raises(StoreUnavailable):
        await store.read("a")
    await names.aclose()
    await store.close()


def _forked_front_end(server: LocalStoreServer, path: str) -> None:
    """As runner/parent.py's _serve: close the copies of the server's sockets, then use the store."""
    server.close_inherited()

    async def main() -> None:
        store = LocalStoreClient(path, TOKEN)
        found = await store.read("served")
        assert found is not None
        await store.write("served", found.body + b"+child", expect=found.revision)
        await store.close()

    asyncio.run(main())


def test_a_front_end_forked_from_the_parent_reaches_its_store(server: LocalStoreServer) -> None:
    import multiprocessing

    server.state.write("served", b"parent")
    child = multiprocessing.get_context("fork").Process(target=_forked_front_end, args=(server, server.path))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    found = server.state.read("served")
    assert found is not None and found.body == b"parent+child" and found.revision == 2


def _sockets_on(path: str) -> int:
    """How many of this process's fds are server-side sockets of `path` (the listener and the
    connections it accepted carry its path in /proc/net/unix; a client's end does not)."""
    with open("/proc/net/unix") as f:
        inodes = {line.split()[6] for line in f.readlines()[1:] if line.split()[-1] == path}
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:[") : -1])
    return len(mine & inodes)


def _count_before_and_after(server: LocalStoreServer, path: str, out: Any) -> None:
    before = _sockets_on(path)
    server.close_inherited()
    out.send((before, _sockets_on(path)))


async def test_a_forked_front_end_keeps_no_copy_of_the_servers_sockets(server: LocalStoreServer) -> None:
    import multiprocessing

    store = LocalStoreClient(server.path, TOKEN)
    names = store.watch()
    first = asyncio.ensure_future(anext(names))
    while not first.done():  # a watch connection and a pooled call connection are open
        await store.write("a", b"1")
        await asyncio.wait([first], timeout=0.05)
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_count_before_and_after, args=(server, server.path, writer))
    child.start()
    before, after = await asyncio.to_thread(reader.recv)
    child.join(30)
    await names.aclose()
    await store.close()
    assert before >= 3  # the listener, the watch's connection, the call's connection
    assert after == 0  # so a connection the server closes is closed for its client too
