"""A scripted front end for pool workers: a Unix socket that speaks the worker protocol, accepts a pool
worker's pool link (Welcome with the pool's settings) and its model links (Welcome with the model's
config), and lets a test send and await messages on each. Nothing of the real front end runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from inferd.models.sim import sim_config
from inferd.wire import protocol as p
from tests.conftest import ROOT

TOKEN = "pool-test-token"


def model_json(name: str, **params: Any) -> bytes:
    """A sim model's config as a Welcome (and a LoadModel) carries it."""
    return sim_config(name, base_ms=5.0, per_item_ms=0.0, params=params).model_dump_json().encode()


class Link:
    """One connection from the worker: its Hello, and what it sends, in order."""

    def __init__(self, hello: p.Hello, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.hello = hello
        self.reader = reader
        self.writer = writer
        self.inbox: asyncio.Queue[p.Message | None] = asyncio.Queue()
        self.closed = asyncio.Event()
        self.seen: list[p.Message] = []

    def send(self, msg: p.Message) -> None:
        self.writer.write(p.encode_frame(msg))

    async def expect(self, kind: type, timeout_s: float = 20.0, where: Callable[[Any], bool] = lambda m: True) -> Any:
        """The next message of `kind` that matches `where` (others are skipped, kept in `seen`)."""
        async with asyncio.timeout(timeout_s):
            while True:
                msg = await self.inbox.get()
                if msg is None:
                    raise AssertionError(f"the link closed while waiting for a {kind.__name__}: {self.seen[-5:]}")
                if isinstance(msg, kind) and where(msg):
                    return msg

    async def read(self) -> None:
        try:
            while True:
                msg = await p.read_message(self.reader)
                self.seen.append(msg)
                self.inbox.put_nowait(msg)
        except p.ConnectionClosed:
            self.inbox.put_nowait(None)
            self.closed.set()


class PoolFront:
    """The fake front end. `pool_config`: the pool's settings its Welcome carries; `models`: each model's
    config JSON for the model links' Welcome."""

    def __init__(self, path: Path, pool_config: dict[str, Any], models: dict[str, bytes]) -> None:
        self.path = path
        self.pool_config = pool_config
        self.models = models
        self.pool_links: asyncio.Queue[Link] = asyncio.Queue()
        self.model_links: asyncio.Queue[Link] = asyncio.Queue()
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> PoolFront:
        self.server = await asyncio.start_unix_server(self._accept, path=str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Go away: stop listening and close every link (as a front end that exits)."""
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await p.read_message(reader)
        assert isinstance(hello, p.Hello), hello
        link = Link(hello, reader, writer)
        if hello.model == "":
            link.send(p.Welcome(True, pool_config_json=msgspec.json.encode(self.pool_config), heartbeat_s=0.2))
            self.pool_links.put_nowait(link)
        else:
            config = self.models[hello.model]
            link.send(p.Welcome(True, model_config_json=config, heartbeat_s=0.2, credits=True))
            self.model_links.put_nowait(link)
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await link.read()
        finally:
            self.tasks.discard(task)
            writer.close()

    async def pool_link(self, timeout_s: float = 20.0) -> Link:
        async with asyncio.timeout(timeout_s):
            return await self.pool_links.get()

    async def model_link(self, timeout_s: float = 20.0) -> Link:
        async with asyncio.timeout(timeout_s):
            return await self.model_links.get()


def _log_file(path: Path) -> BinaryIO:
    return open(path, "wb")  # the child writes to it; closed when the spawn returns


async def start_pool_worker(
    socket_path: Path, log_path: Path, pool: str = "p", reconnect: bool = True
) -> asyncio.subprocess.Process:
    """A pool worker joining the fake front end: a remote one (`reconnect`), or one as a front end starts
    it (its front end is its lifeline)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with _log_file(log_path) as log:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "inferd.worker.main", "--pool", pool, "--connect", f"unix:{socket_path}",
            "--token", TOKEN, "--worker-id", "pw-1", *(["--reconnect"] if reconnect else []),
            stdout=log, stderr=asyncio.subprocess.STDOUT, cwd=ROOT, env=env,
        )


async def stop(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def serve_one_batch(link: Link, batch_id: int, inputs: list[bytes]) -> p.BatchDone:
    """After its Ready: wait for a Credit, send a RunBatch, return its BatchDone."""
    await link.expect(p.Credit, where=lambda c: c.granted > 0)
    link.send(p.RunBatch(batch_id, list(inputs)))
    done = await link.expect(p.BatchDone, where=lambda d: d.batch_id == batch_id)
    assert isinstance(done, p.BatchDone)
    return done
