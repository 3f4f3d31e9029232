"""Requests, responses and routes of the HTTP front end, and the app that runs them.

The front door (api/frontdoor.py, our HTTP/1.1 connection) hands each request to `AsgiApp.handle` as an
`HttpRequest` whose `peer` is the connection itself: the body, the disconnect and the response go
through it with no ASGI messages. `AsgiApp` is also an ASGI app, for the lifespan (uvicorn's server runs
it) and for running the same routes under any ASGI server or in-process (`peer.AsgiPeer`).

Why not Starlette: measured on the 2-core target, Starlette's middleware stack, Request and Response
objects cost ~80 us of the ~350 us per-request CPU budget of the infer path (py-spy, 1,000 req/s).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from inferd.api.peer import AsgiPeer, Peer, Receive, Send
from inferd.core.disconnect import ClientGone, until_disconnect

log = logging.getLogger("inferd.api")

Scope = dict[str, Any]


class HttpRequest:
    __slots__ = (
        "_headers",
        "body_ended",
        "close_connection",
        "method",
        "path",
        "path_params",
        "peer",
        "scope",
    )

    def __init__(self, scope: Scope, peer: Peer, path_params: dict[str, str]) -> None:
        self.scope = scope
        """method, path, headers (lower-case names), query_string, client: as in ASGI's scope."""
        self.peer = peer
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.path_params = path_params
        self._headers: dict[bytes, bytes] | None = None
        self.close_connection = False
        """Set when the request's body was not read to its end: the response closes the connection."""
        self.body_ended = False
        """Set once `chunks` has read the body's last message: nothing more comes until a disconnect."""

    def header(self, name: bytes) -> str | None:
        """Header value by lower-case name (the last one wins if repeated)."""
        if self._headers is None:
            self._headers = dict(self.scope["headers"])
        value = self._headers.get(name)
        return None if value is None else value.decode("latin-1")

    async def read(self) -> tuple[bytes, bool]:
        """The next piece of the body and whether more follows (ConnectionAbortedError: the client left)."""
        chunk, more = await self.peer.read()
        self.body_ended = not more  # known before the chunk is used
        return chunk, more

    async def chunks(self) -> AsyncIterator[bytes]:
        while not self.body_ended:
            chunk, _ = await self.read()
            if chunk:
                yield chunk


@dataclass(slots=True)
class HttpResponse:
    """A whole response; a core/call.py `Reply` (its metadata: the headers)."""

    body: bytes = b""
    status: int = 200
    content_type: bytes | None = b"application/json"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    streamed: ClassVar[bool] = False

    @property
    def metadata(self) -> list[tuple[bytes, bytes]]:
        return self.headers

    def on_close(self, callback: Callable[[], None]) -> None:
        """A whole response has ended when the chain returns it: `callback` runs now."""
        callback()

    async def send(self, peer: Peer) -> None:
        headers = self.headers
        if self.content_type is not None:
            headers = [(b"content-type", self.content_type), *headers]
        await peer.respond(self.status, headers, self.body)

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


class StreamingResponse:
    """A response whose body is an async iterator of chunks (Server-Sent Events), sent as they come.

    While it streams, the client is watched for a disconnect (until_disconnect): when it goes away the
    body iterator is cancelled and closed, so its `finally` runs (the LLM routes abort the sequence there).
    A core/call.py `Reply` that is `streamed`.
    """

    __slots__ = ("_on_close", "body", "content_type", "headers", "status")
    streamed: ClassVar[bool] = True

    def __init__(
        self,
        body: AsyncIterator[bytes],
        content_type: bytes = b"text/event-stream",
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.body = body
        self.status = 200
        self.content_type = content_type
        self.headers = headers or []
        self._on_close: list[Callable[[], None]] = []

    @property
    def metadata(self) -> list[tuple[bytes, bytes]]:
        return self.headers

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run `callback` once the stream has ended, however it ended (the request accounting)."""
        self._on_close.append(callback)

    async def send(self, peer: Peer) -> None:
        try:
            await self._stream(peer)
        finally:
            for callback in self._on_close:
                callback()

    async def _stream(self, peer: Peer) -> None:
        headers = [(b"content-type", self.content_type), (b"cache-control", b"no-cache"), *self.headers]
        try:
            await until_disconnect(peer, self._pump(peer, headers))
        except (ClientGone, OSError):  # the client went away (OSError: while a chunk was sent)
            log.debug("client left a %s stream before its end", self.content_type.decode())
        finally:
            await self.body.aclose()  # type: ignore[attr-defined]

    async def _pump(self, peer: Peer, headers: list[tuple[bytes, bytes]]) -> None:
        await peer.start_stream(self.status, headers)
        async for chunk in self.body:
            await peer.write(chunk)
        await peer.end_stream()

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


Response = HttpResponse | StreamingResponse
"""The HTTP edge's replies."""
Handler = Callable[[HttpRequest], Awaitable[Response]]


class Router:
    """Routes like '/v2/models/{model}/versions/{version}/infer' to handlers, by method."""

    def __init__(self) -> None:
        self._exact: dict[tuple[str, str], Handler] = {}
        self._patterns: list[tuple[str, re.Pattern[str], Handler]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        if "{" not in path:
            self._exact[(method, path)] = handler
            return
        regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", path)
        self._patterns.append((method, re.compile(f"^{regex}$"), handler))

    def match(self, method: str, path: str) -> tuple[Handler | None, dict[str, str], bool]:
        """(handler, path params, whether the path exists for another method)."""
        handler = self._exact.get((method, path))
        if handler is not None:
            return handler, {}, False
        other = False
        for m, regex, h in self._patterns:
            found = regex.match(path)
            if found is None:
                continue
            if m == method:
                return h, found.groupdict(), False
            other = True
        return None, {}, other or any(p == path for m, p in self._exact if m != method)


class AsgiApp:
    def __init__(
        self,
        router: Router,
        lifespan: Callable[[], AbstractAsyncContextManager[None]],
        not_found: Callable[[HttpRequest, bool], HttpResponse],
    ) -> None:
        self.router = router
        self.lifespan = lifespan
        self.not_found = not_found

    async def handle(self, scope: Scope, peer: Peer) -> None:
        """One request: routed, answered through `peer`."""
        handler, params, other = self.router.match(scope["method"], scope["path"])
        request = HttpRequest(scope, peer, params)
        if handler is None:
            await self.not_found(request, other).send(peer)
            return
        response = await handler(request)
        if request.close_connection:
            response.headers.append((b"connection", b"close"))
        await response.send(peer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.handle(scope, AsgiPeer(receive, send))
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        started = False
        try:
            async with self.lifespan():
                await send({"type": "lifespan.startup.complete"})
                started = True
                await receive()  # lifespan.shutdown
        except Exception as exc:
            log.exception("server %s failed", "shutdown" if started else "startup")
            kind = "lifespan.shutdown.failed" if started else "lifespan.startup.failed"
            await send({"type": kind, "message": repr(exc)})
            return
        await send({"type": "lifespan.shutdown.complete"})
