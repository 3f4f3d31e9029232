"""A userspace TCP relay for network-fault tests: delay, and hold-then-release.

    relay = Relay(("10.200.0.1", 0), ("10.200.0.1", router_worker_port), delay_s=0.2)
    port = relay.start()          # the worker connects here instead of to the router
    relay.hold()                  # worker -> router data is read and kept, not forwarded
    relay.release()               # ... then forwarded, or discarded where the router side has closed
    relay.close()

Each chunk is forwarded `delay_s` after it was read, in order, each way (latency, not a bandwidth limit).
While held, the worker -> router direction buffers what the worker sends (results, heartbeats, a new
connection's hello); the router -> worker direction keeps flowing, so a router that closes the connection
is seen by the worker at once, as on a real network. The relay runs its own event loop in a thread, so
synchronous tests drive it; counters (`statistics`) say what was forwarded, held and discarded.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

CHUNK = 65536
T = TypeVar("T")


@dataclass(frozen=True)
class RelayStatistics:
    connections: int
    forwarded_bytes: int
    held_bytes: int
    """Worker -> router bytes waiting for release()."""
    discarded_bytes: int
    """Bytes that found their destination closed (late data on a dead connection)."""


class _Pipe:
    """One direction of one connection: read, stamp, wait out the delay (and any hold), write."""

    def __init__(
        self, relay: Relay, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool
    ) -> None:
        self.relay, self.reader, self.writer, self.upstream = relay, reader, writer, upstream
        self.chunks: deque[tuple[float, bytes]] = deque()
        self.more = asyncio.Event()
        self.ended = False

    async def read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while chunk := await self.reader.read(CHUNK):
                self.chunks.append((loop.time() + self.relay.delay_s, chunk))
                self.more.set()
        except OSError:
            pass
        self.ended = True
        self.more.set()

    async def write(self) -> None:
        loop = asyncio.get_running_loop()
        while self.chunks or not self.ended:
            if not self.chunks or (self.upstream and self.relay.held):
                self.more.clear()
                await self.more.wait()
                continue
            due, chunk = self.chunks[0]
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
                continue
            self.chunks.popleft()
            if self.writer.is_closing():
                self.relay.discarded += len(chunk)
                continue
            self.writer.write(chunk)
            self.relay.forwarded += len(chunk)
            try:
                await self.writer.drain()
            except OSError:
                self.writer.close()
        if not self.writer.is_closing() and self.writer.can_write_eof():
            self.writer.write_eof()

    def held_bytes(self) -> int:
        return sum(len(c) for _, c in self.chunks) if self.upstream else 0


class Relay:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float = 0.0) -> None:
        self.listen, self.target, self.delay_s = listen, target, delay_s
        self.held = False
        self.forwarded = self.discarded = self.connections = 0
        self._pipes: list[_Pipe] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="relay", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> int:
        """Listen; returns the port the worker should connect to."""
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._handle, *self.listen))
        return self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        self._loop.call_soon_threadsafe(self._set_held, True)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._set_held, False)

    def statistics(self) -> RelayStatistics:
        async def snapshot() -> RelayStatistics:
            held = sum(p.held_bytes() for p in self._pipes)
            return RelayStatistics(self.connections, self.forwarded, held, self.discarded)

        return self._call(snapshot())

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- on the relay's loop -------------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def _set_held(self, held: bool) -> None:
        self.held = held
        for pipe in self._pipes:
            pipe.more.set()

    async def _handle(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            down_w.close()
            self._tasks.discard(task)
            return
        to_router = _Pipe(self, down_r, up_w, upstream=True)
        to_worker = _Pipe(self, up_r, down_w, upstream=False)
        self._pipes.extend((to_router, to_worker))
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(to_router.read())
                tg.create_task(to_router.write())
                tg.create_task(self._router_side(to_worker, up_w))
                tg.create_task(to_worker.write())
        finally:
            for pipe in (to_router, to_worker):
                self._pipes.remove(pipe)
            up_w.close()
            down_w.close()
            self._tasks.discard(task)

    @staticmethod
    async def _router_side(to_worker: _Pipe, up_w: asyncio.StreamWriter) -> None:
        """Once the router closed its end, whatever the worker still sends it is discarded (a real
        router's kernel would answer it with a reset)."""
        await to_worker.read()
        up_w.transport.abort()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
