"""One request and its response on a front-door connection: the `Peer` an HttpRequest reads its body
from, watches for a disconnect through, and answers through (api/disconnect.py).

The body is what the parser buffered (no message per chunk); a disconnect calls the watchers back at
once; a whole response is one write of its head and body, a stream is chunked and waits for the
transport to drain. Responses after the client left are dropped, as are body bytes after the response.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from functools import partial
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote

import httptools

from inferd.api.errors import error_headers, status_of
from inferd.errors import ServingError

if TYPE_CHECKING:
    from inferd.api.asgi import AsgiApp

log = logging.getLogger("inferd.frontdoor")

HIGH_WATER_BYTES = 65536
"""A body buffered past this pauses reading until the app takes it."""
STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
INTERNAL = b"Internal Server Error"
_BAD_REQUEST = (
    b"content-type: text/plain; charset=utf-8\r\ncontent-length: 30\r\nconnection: close\r\n\r\n"
    b"Invalid HTTP request received."
)


def _refusal_body(exc: ServingError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    status, _ = status_of(exc)
    body = json.dumps({"error": exc.message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return status, headers + error_headers(exc), body


def canned_response(exc: ServingError, close: bool = True) -> bytes:
    """A whole HTTP/1.1 response for `exc`, written without the app."""
    status, headers, body = _refusal_body(exc)
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    head += [name + b": " + value for name, value in headers]
    if close:
        head.append(b"connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class Connection(Protocol):
    """What an exchange needs of its connection (api/frontdoor.FrontDoorProtocol)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    server_state: Any
    """uvicorn's: its `default_headers` (date, server) go on every response."""

    def resume_reading(self) -> None: ...

    async def drain(self) -> None: ...

    def response_done(self, ex: Exchange | None) -> None: ...


_DEFAULT_HEAD: list[object] = [None, b""]
"""uvicorn's default headers (date, server) as header lines, for the list they were made from."""


def default_head(headers: list[tuple[bytes, bytes]]) -> bytes:
    """`server_state.default_headers` as header lines (a new list each second: uvicorn's date)."""
    cached = _DEFAULT_HEAD
    if cached[0] is not headers:
        cached[:] = [headers, b"".join([b"%s: %s\r\n" % pair for pair in headers])]
    return cached[1]  # type: ignore[return-value]


def bad_request(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """uvicorn's 400 for a request the parser rejects, with its date and server headers."""
    return STATUS_LINES[400] + default_head(default_headers) + _BAD_REQUEST


def request_scope(
    parser: httptools.HttpRequestParser,
    url: bytes,
    headers: list[tuple[bytes, bytes]],
    client: tuple[str, int] | None,
    scheme: str,
) -> dict[str, Any]:
    """A parsed head as the app reads it: ASGI's scope keys (lower-case header names)."""
    parsed = httptools.parse_url(url)
    path = parsed.path.decode("ascii")
    if "%" in path:
        path = unquote(path)
    return {
        "type": "http",
        "method": parser.get_method().decode("ascii"),
        "path": path,
        "query_string": parsed.query or b"",
        "headers": headers,
        "http_version": parser.get_http_version(),
        "client": client,
        "scheme": scheme,
    }


def _unwatched() -> None:
    return None


class Exchange:
    __slots__ = (
        "_body",
        "_body_bytes",
        "_waiter",
        "_watchers",
        "body_complete",
        "chunked",
        "complete",
        "conn",
        "expect_continue",
        "gone",
        "keep_alive",
        "refusal",
        "response_started",
        "scope",
    )

    def __init__(
        self, conn: Connection, scope: dict[str, Any], keep_alive: bool, expect_continue: bool
    ) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue and scope["http_version"] != "1.0"  # (1.0 has no 100)
        self.refusal: ServingError | None = None
        """A canned answer written instead of running the app (a pipelined request refused at its head)."""
        self._body: list[bytes] = []
        self._body_bytes = 0
        self.body_complete = False
        self._waiter: asyncio.Future[None] | None = None
        self._watchers: list[Callable[[], None]] | None = None
        self.gone = False
        self.response_started = False
        self.chunked = False
        self.complete = False

    # ---- the connection's side --------------------------------------------------------------------

    def add_body(self, data: bytes) -> int:
        """A piece of the body from the parser; the bytes now buffered."""
        if self.complete or self.gone:
            return 0  # answered already (or nobody to answer): the rest of the body is dropped
        self._body.append(data)
        self._body_bytes += len(data)
        self._wake()
        return self._body_bytes

    def end_body(self) -> None:
        self.body_complete = True
        self._wake()

    def lost(self) -> None:
        """The client is gone (or the door cut it off): reads fail, watchers are told, writes dropped."""
        if self.gone:
            return
        self.gone = True
        self._wake()
        watchers, self._watchers = self._watchers, None
        for on_gone in watchers or ():
            on_gone()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def run(self, app: AsgiApp) -> None:
        try:
            if self.refusal is not None:
                self._write(canned_response(self.refusal, close=not self.keep_alive))
                self._finish()
                return
            await app.handle(self.scope, self)
        except Exception:
            log.exception("exception in the request handler")
            self._abort()
        finally:
            if not self.complete:
                self._abort()

    def _abort(self) -> None:
        """The app failed, or returned without a whole response: a 500 if nothing was sent, else a close."""
        if self.complete or self.gone:
            return
        if self.response_started:
            self.conn.transport.close()
            return
        self.keep_alive = False
        self.response_started = True
        head = STATUS_LINES[500] + b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        self._write(head + b"content-length: %d\r\n\r\n" % len(INTERNAL) + INTERNAL)
        self._finish()

    # ---- the app's side: disconnect.Peer ----------------------------------------------------------

    async def read(self) -> tuple[bytes, bool]:
        if self.expect_continue:
            self.expect_continue = False
            if not self.response_started and not self.gone:
                self._write(CONTINUE)
        while not self._body and not self.body_complete and not self.gone:
            self.conn.resume_reading()
            self._waiter = waiter = self.conn.loop.create_future()
            await waiter
        if self.gone:
            raise ConnectionAbortedError("client disconnected while sending the body")
        body = self._body
        data = body[0] if len(body) == 1 else b"".join(body)
        self._body = []
        self._body_bytes = 0
        if not self.body_complete:  # (else what is read now is a pipelined request's, in its turn)
            self.conn.resume_reading()
        return data, not self.body_complete

    def watch(self, on_gone: Callable[[], None]) -> Callable[[], None]:
        if self.gone:
            self.conn.loop.call_soon(on_gone)
            return _unwatched
        if self._watchers is None:
            self._watchers = []
        self._watchers.append(on_gone)
        return partial(self._unwatch, on_gone)

    def _unwatch(self, on_gone: Callable[[], None]) -> None:
        if self._watchers is not None and on_gone in self._watchers:
            self._watchers.remove(on_gone)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        await self.conn.drain()  # a client reading none of the answers before gets no more (as uvicorn)
        if self.gone or self.response_started:
            return
        head = self._head(status, headers)
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        if self.scope["method"] != "HEAD":
            head.append(body)
        self._write(b"".join(head))
        self._finish()

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.gone or self.response_started:
            return
        head = self._head(status, headers)
        self.chunked = self.scope["http_version"] != "1.0"  # else it ends with the close (1.0 has none)
        head.append(b"transfer-encoding: chunked\r\n\r\n" if self.chunked else b"\r\n")
        self._write(b"".join(head))

    async def write(self, chunk: bytes) -> None:
        if self.gone or self.complete or not chunk:
            return
        self._write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.chunked else chunk)
        await self.conn.drain()

    async def end_stream(self) -> None:
        if self.gone or self.complete:
            return
        if self.chunked:
            self._write(b"0\r\n\r\n")
        self._finish()

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> list[bytes]:
        lines = b"".join([b"%s: %s\r\n" % pair for pair in headers])
        n = len(headers)
        if lines.count(b"\n") != n or lines.count(b"\r") != n:  # a CR or LF inside a name or value
            raise RuntimeError(f"invalid HTTP header in {headers!r}")
        self.response_started = True
        if self.expect_continue and not self.body_complete:  # no 100 Continue: the body may never come
            self.keep_alive = False
        if self.keep_alive and b"connection: close\r\n" in lines:  # the app asked to close (asgi.py)
            self.keep_alive = False
        elif not self.keep_alive:
            lines += b"connection: close\r\n"
        return [
            STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status,
            default_head(self.conn.server_state.default_headers),
            lines,
        ]

    def _write(self, data: bytes) -> None:
        transport = self.conn.transport
        if not transport.is_closing():
            transport.write(data)

    def _finish(self) -> None:
        self.complete = True
        self._watchers = None
        self.conn.response_done(self)
