"""Watching for a client that disconnects while its request's work runs: one helper for every route.

`until_disconnect(peer, work)` awaits `work` while `peer` (the client's side of the request) watches for
a disconnect. If the client leaves first, `work` is cancelled and ClientGone raised (a 499); if `work`
ends first, the watch is dropped and the result returned.

Our HTTP connection (api/frontdoor.py) knows at once when its client leaves, so its watch is a callback
in a list: no task and no timer per request. `AsgiPeer` gives the same watch over an ASGI `receive()`
(a task reading it until `http.disconnect`), for the app run by another ASGI server or in-process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from inferd.errors import ClientGone

__all__ = ["AsgiPeer", "ClientGone", "Peer", "Receive", "Send", "Unwatch", "until_disconnect"]

log = logging.getLogger("inferd.api")

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Unwatch = Callable[[], None]


class Peer(Protocol):
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


async def until_disconnect(peer: Peer, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled and ClientGone is raised.

    A future (the infer path's replies) is awaited in the calling task, with no task of its own; a
    coroutine runs in a task this call owns and awaits. If the caller itself is cancelled, `work` is
    cancelled too and CancelledError propagates, even when the client has left as well."""
    fut = work if isinstance(work, asyncio.Future) else asyncio.ensure_future(work)
    gone = False

    def on_gone() -> None:
        nonlocal gone
        gone = True
        fut.cancel()  # no effect if the work has ended already: its result stands

    unwatch = peer.watch(on_gone)
    try:
        return await fut
    except asyncio.CancelledError:
        caller = asyncio.current_task()  # looked up only here: the common path stays cheap
        caller_cancelled = caller is not None and caller.cancelling() > 0
        if gone and not caller_cancelled:
            raise ClientGone() from None
        raise
    finally:
        unwatch()


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
