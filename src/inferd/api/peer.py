"""The client's side of one HTTP request: `Peer` (its body, its disconnect, where the response goes).

Our HTTP connection (api/exchange.py, under api/frontdoor.py) is a Peer that knows at once when its
client leaves, so its watch is a callback in a list: no task and no timer per request. `AsgiPeer` gives
the same over ASGI's `receive()` and `send()` (a task reading `receive()` until `http.disconnect`), for
the app run by another ASGI server or in-process. A Peer is the Call's `departure`
(core/disconnect.py): waiting code watches it with `until_disconnect` and knows no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from inferd.core.disconnect import Departure, Unwatch

log = logging.getLogger("inferd.api")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Peer(Departure, Protocol):
    """The client's side of one request: its body, its disconnect, and where the response goes."""

    async def read(self) -> tuple[bytes, bool]:
        """The next piece of the body and whether more follows; ConnectionAbortedError if the client left."""
        ...

    def watch(self, on_gone: Callable[[], None]) -> Unwatch:
        """Call `on_gone` once if the client disconnects (soon, if it has already); the result stops it."""
        ...

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole response (headers without Content-Length: it is added)."""
        ...

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def write(self, chunk: bytes) -> None: ...

    async def end_stream(self) -> None: ...


class AsgiPeer:
    """A `Peer` over ASGI's receive() and send()."""

    __slots__ = ("_disconnected", "_receive", "_send")

    def __init__(self, receive: Receive, send: Send | None = None) -> None:
        self._receive = receive
        self._send = send
        self._disconnected = False

    async def read(self) -> tuple[bytes, bool]:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self._disconnected = True
            raise ConnectionAbortedError("client disconnected while sending the body")
        return message.get("body", b""), message.get("more_body", False)

    def watch(self, on_gone: Callable[[], None]) -> Unwatch:
        watch = _Watch(self._receive, on_gone)
        if self._disconnected:
            asyncio.get_running_loop().call_soon(on_gone)
        else:
            watch.start()
        return watch.stop

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        headers = [(b"content-length", str(len(body)).encode()), *headers]
        await self._out({"type": "http.response.start", "status": status, "headers": headers})
        await self._out({"type": "http.response.body", "body": body})

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._out({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, chunk: bytes) -> None:
        await self._out({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end_stream(self) -> None:
        await self._out({"type": "http.response.body", "body": b"", "more_body": False})

    async def _out(self, message: dict[str, Any]) -> None:
        if self._send is None:
            raise RuntimeError("this AsgiPeer has no send(): it only reads a request")
        await self._send(message)


class _Watch:
    """Reads receive() (a task per message: an ASGI receive() is a coroutine) until the client
    disconnects, then calls `on_gone`. A receive() that fails counts as a disconnect: the connection
    cannot carry an answer either way."""

    __slots__ = ("on_gone", "receive", "stopped", "task")

    def __init__(self, receive: Receive, on_gone: Callable[[], None]) -> None:
        self.receive = receive
        self.on_gone = on_gone
        self.task: asyncio.Task[dict[str, Any]] | None = None
        self.stopped = False

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.receive())  # type: ignore[arg-type]
        self.task.add_done_callback(self._received)

    def stop(self) -> None:
        self.stopped = True
        if self.task is not None and not self.task.done():
            self.task.cancel()  # its receive() ends on the loop's next turn; nothing waits for it

    def _received(self, task: asyncio.Task[dict[str, Any]]) -> None:
        if task.cancelled() or self.stopped:  # the work ended first
            return
        exc = task.exception()
        if exc is None and task.result().get("type") != "http.disconnect":
            self.start()  # another message (a body chunk): keep watching
            return
        if exc is not None:
            log.debug("receive() failed while watching for a disconnect: %r", exc)
        self.on_gone()
