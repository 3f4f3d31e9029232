"""The HTTP clients `inferd bench` sends with: `post(body, deadline) -> (status, headers, body)`.

The default, `raw`, is a lean HTTP/1.1 client written for this generator: a pool of keep-alive asyncio
connections, request bytes built in one formatting step, and responses parsed by httptools, at a few
tens of microseconds of CPU per request, so the generator can offer thousands of requests per second
while sharing the machine with the server it measures. `aiohttp` (several times the CPU per request) is
kept for comparison.
"""

from __future__ import annotations

import asyncio
import math
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp
import httptools

from inferd.bench.load_spec import LoadSpec

Answer = tuple[int, Mapping[str, str], bytes]


class HttpClient(Protocol):
    """What the engine needs from an HTTP client. Connection failures raise OSError or aiohttp.ClientError;
    the caller bounds each call with its deadline (cancellation) and counts that as a timeout."""

    async def start(self) -> None: ...

    async def post(self, body: bytes, deadline: float) -> Answer: ...

    async def close(self) -> None: ...


def _extra_headers(spec: LoadSpec) -> dict[str, str]:
    extra = {"X-Priority": spec.priority} if spec.priority is not None else {}
    return extra | dict(spec.headers)


class AiohttpClient:
    """The aiohttp client: general and well tested, but ~250 us of CPU per request."""

    def __init__(self, spec: LoadSpec, now: Callable[[], float]) -> None:
        self._endpoint = spec.endpoint
        self._send_deadline = spec.send_deadline
        self._headers = {"Content-Type": "application/json"} | _extra_headers(spec)
        self._now = now
        connector = aiohttp.TCPConnector(limit=spec.connections, limit_per_host=0, ttl_dns_cache=None)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),  # deadlines are the caller's
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
        )

    async def start(self) -> None:
        pass

    async def post(self, body: bytes, deadline: float) -> Answer:
        headers = self._headers
        if self._send_deadline:
            remaining_ms = max(1, int((deadline - self._now()) * 1000.0))
            headers = headers | {"X-Request-Timeout-Ms": str(remaining_ms)}
        async with self._session.post(self._endpoint, data=body, headers=headers) as resp:
            return resp.status, resp.headers, await resp.read()

    async def close(self) -> None:
        await self._session.close()


class HttpProtocolError(ConnectionError):
    """The server sent bytes that are not a valid HTTP/1.1 response, or sent them unasked."""


# Response headers the engine reads, by lower-cased name, mapped to the spelling `Recorder` looks up.
_WANTED_HEADERS = {
    name.lower().encode(): name
    for name in (
        "X-Inferd-Queue-Ms",
        "X-Inferd-Compute-Ms",
        "X-Inferd-Batch-Size",
        "X-Inferd-Attempts",
        "Retry-After",
    )
}
_FRAMING_HEADERS = frozenset((b"content-length", b"transfer-encoding"))


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time, parsed by httptools."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[Answer] | None = None
        self._status = 0
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._framed = False
        self._headers_done = False
        self.closed = False
        """Set on EOF, loss, error or abort: never hand this connection out again."""
        self.keep_alive = True
        """After an answer: whether the server lets the connection carry another request."""

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: this connection can't be trusted
            self.abort()
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(HttpProtocolError(f"bad HTTP response: {exc}"))

    def eof_received(self) -> bool:
        self.closed = True
        return False  # let the transport close; connection_lost settles any pending answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if exc is None and self._headers_done and not self._framed:
            # No Content-Length and not chunked: the body ran to the end of the connection.
            self._waiter = None
            self.keep_alive = False
            waiter.set_result((self._status, self._headers, b"".join(self._body)))
        else:
            self._fail(exc or ConnectionResetError("connection closed before a complete response"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._status = 0
        self._headers = {}
        self._body = []
        self._framed = False
        self._headers_done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        key = _WANTED_HEADERS.get(lname)
        if key is not None:
            self._headers[key] = value.decode("latin-1")
        elif lname in _FRAMING_HEADERS:
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        waiter = self._waiter
        self._waiter = None
        self.keep_alive = self._parser.should_keep_alive()
        if waiter is not None and not waiter.done():
            body = self._body
            waiter.set_result((self._status, self._headers, body[0] if len(body) == 1 else b"".join(body)))

    # for the pool
    def request(self, data: bytes) -> asyncio.Future[Answer]:
        """Send one complete request; the future resolves with its answer (or the connection's failure)."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        self._transport.write(data)  # type: ignore[union-attr]
        return waiter

    def abort(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    def _fail(self, exc: BaseException) -> None:
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.abort()


class RawClient:
    """A lean HTTP/1.1 client for one host: a pool of keep-alive connections, one request per connection
    at a time (no pipelining), pre-built request bytes, httptools parsing.

    A request takes the most recently idle connection, else opens a new one while fewer than
    `connections` are open, else waits (FIFO) for one to come back. A connection is discarded when the
    server asks to close it, when it fails, and when its request is cancelled (deadline or hard stop) with
    the answer still pending, so a late answer can never be read as the next request's.
    """

    def __init__(
        self,
        endpoint: str,
        now: Callable[[], float],
        *,
        connections: int,
        rate: float,
        timeout_ms: float,
        send_deadline: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        parts = urlsplit(endpoint)
        self._host = parts.hostname or ""
        https = parts.scheme == "https"
        self._port = parts.port or (443 if https else 80)
        self._ssl = ssl.create_default_context() if https else None
        self._limit = connections
        self._prewarm = min(connections, 64, max(1, math.ceil(rate / 500.0)))
        self._connect_wait_s = min(1.0, timeout_ms / 1000.0)
        self._send_deadline = send_deadline
        self._now = now
        head = f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = head.encode("latin-1")
        self._loop = asyncio.get_running_loop()
        self._idle: deque[_Connection] = deque()
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self._all: set[_Connection] = set()
        self._open = 0
        """Connections open or being opened, against the limit."""

    @classmethod
    def for_spec(cls, spec: LoadSpec, now: Callable[[], float]) -> RawClient:
        """The client `inferd bench` sends `spec`'s requests with."""
        return cls(
            spec.endpoint,
            now,
            connections=spec.connections,
            rate=spec.rate,
            timeout_ms=spec.timeout_ms,
            send_deadline=spec.send_deadline,
            headers=_extra_headers(spec),
        )

    def build(self, body: bytes, deadline: float) -> bytes:
        """The whole request: request line, headers and body, in one bytes object."""
        if self._send_deadline:
            remaining_ms = max(1, int((deadline - self._now()) * 1000.0))
            return b"%sX-Request-Timeout-Ms: %d\r\nContent-Length: %d\r\n\r\n%s" % (
                self._head,
                remaining_ms,
                len(body),
                body,
            )
        return b"%sContent-Length: %d\r\n\r\n%s" % (self._head, len(body), body)

    async def start(self) -> None:
        """Open a few connections before the first request: 2 ms of the offered rate, at most 64."""
        connects = [asyncio.ensure_future(self._connect()) for _ in range(self._prewarm)]
        await asyncio.wait(connects, timeout=self._connect_wait_s)
        for connect in connects:
            if not connect.done():
                connect.cancel()
                continue
            exc = connect.exception()
            if exc is None:
                self._open += 1
                self._idle.append(connect.result())
            elif not isinstance(exc, OSError):  # refused etc. show up per request; others are bugs
                raise exc
        if any(not c.done() for c in connects):
            await asyncio.wait(connects)  # let the cancelled ones finish unwinding

    async def post(self, body: bytes, deadline: float) -> Answer:
        conn = await self._acquire()
        reuse = False
        try:
            answer = await conn.request(self.build(body, deadline))
            reuse = conn.keep_alive
            return answer
        finally:
            self._release(conn, reuse)

    async def close(self) -> None:
        for conn in self._all:
            conn.abort()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost callbacks run

    async def _acquire(self) -> _Connection:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
            self._discard(conn)
            self._open -= 1
        if self._open < self._limit:
            self._open += 1
        else:
            waiter: asyncio.Future[_Connection | None] = self._loop.create_future()
            self._waiters.append(waiter)
            try:
                handed = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # handed over just as we were cancelled
                    conn_or_slot = waiter.result()
                    if conn_or_slot is None:
                        self._free_slot()
                    else:
                        self._release(conn_or_slot, True)
                raise
            if handed is not None:
                return handed
            # None: a slot was freed and counted as ours; open a connection in it.
        try:
            return await self._connect()
        except BaseException:
            self._free_slot()
            raise

    async def _connect(self) -> _Connection:
        loop = self._loop
        _, conn = await loop.create_connection(
            lambda: _Connection(loop), self._host, self._port, ssl=self._ssl
        )
        self._all.add(conn)
        return conn

    def _release(self, conn: _Connection, reuse: bool) -> None:
        if reuse and not conn.closed:
            waiters = self._waiters
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(conn)
                    return
            self._idle.append(conn)
            return
        conn.abort()
        self._discard(conn)
        self._free_slot()

    def _discard(self, conn: _Connection) -> None:
        self._all.discard(conn)

    def _free_slot(self) -> None:
        """A connection is gone: give its slot to the first live waiter, else shrink the count."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._open -= 1


def make_client(spec: LoadSpec, now: Callable[[], float]) -> HttpClient:
    """The client `spec.client` names; call from inside the running loop."""
    if spec.client == "aiohttp":
        return AiohttpClient(spec, now)
    return RawClient.for_spec(spec, now)
