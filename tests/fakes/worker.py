"""A worker connection without a process or a socket: what the front end sends is only recorded, and the
test plays the worker's answers (BatchDone) and its death (on_worker_lost)."""

from __future__ import annotations

import asyncio

from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection


class FakeTransport:
    def abort(self) -> None:
        pass


class FakeWriter:
    transport = FakeTransport()

    def __init__(self, broken: bool = False) -> None:
        self.closed = False
        self.broken = broken
        """Writes raise, as a socket that failed under the writer would."""
        self.frames: list[bytes] = []
        self._wrote = asyncio.Event()

    def write(self, data: bytes) -> None:
        assert not self.closed, "a frame was sent to a dead worker"
        if self.broken:
            raise ConnectionResetError("the fake worker's socket is broken")
        self.frames.append(data)
        self._wrote.set()

    async def frame(self, n: int) -> p.Message:
        """The `n`th frame written (from 0), once it is."""
        while len(self.frames) <= n:
            self._wrote.clear()
            await self._wrote.wait()
        reader = asyncio.StreamReader()
        reader.feed_data(self.frames[n])
        reader.feed_eof()
        return await p.read_message(reader)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def fake_connection(
    worker_id: str, pid: int, model: str = "sim", broken: bool = False, writer: FakeWriter | None = None
) -> WorkerConnection:
    """A version-1 connection of `model`, not yet added to a runtime. Connections given the same `writer`
    record their frames in one list, in the order they were sent."""
    writer = writer or FakeWriter(broken)
    conn = WorkerConnection(worker_id, model, pid, "h", writer)  # type: ignore[arg-type]
    conn.version = 1
    return conn
