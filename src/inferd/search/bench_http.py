"""The load generator's HTTP client: keep-alive HTTP/1.1 POSTs on asyncio protocols, nothing else.

`inferd bench-search` runs on the same cores as the server it measures, so its own CPU per request is
taken from the server's: this client builds each request from pre-encoded bytes and parses only the
status line and Content-Length of the answer (aiohttp's client cost about 0.8 ms of CPU a search).
Connections are kept and reused; at most `limit` are open, and a request waits for a free one.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit


class HttpError(ConnectionError):
    """The server closed the connection mid-answer, or answered something this client does not read."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.status = 0
        self.length = -1
        """The answer's Content-Length once its head is read; -1 before."""
        self.reusable = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(HttpError(f"connection closed: {exc}" if exc else "connection closed"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.length < 0 and not self._head():
            return
        if len(self.buf) >= self.length and self.waiter is not None and not self.waiter.done():
            body = bytes(self.buf[: self.length])
            del self.buf[: self.length]
            self.waiter.set_result((self.status, body))

    def _head(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(self.buf[:end]).lower()
        del self.buf[: end + 4]
        self.status = int(head[9:12])
        self.reusable = b"\r\nconnection: close" not in head
        at = head.find(b"\r\ncontent-length:")
        if at < 0:
            self.reusable = False
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(HttpError("an answer without Content-Length"))
            return False
        line_end = head.find(b"\r\n", at + 2)
        self.length = int(head[at + 17 : line_end if line_end >= 0 else len(head)])
        return True

    async def request(self, data: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.length = -1
        self.transport.write(data)
        return await self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class HttpPool:
    """POST JSON bodies to one server (http:// or https://) over at most `limit` kept-alive connections."""

    def __init__(self, url: str, limit: int = 100) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.tls else 80)
        self._slots = asyncio.Semaphore(limit)
        self._idle: list[_Connection] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body) of one POST; HttpError or OSError when the connection fails."""
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        async with self._slots:
            conn = await self._connection()
            try:
                answer = await conn.request(head + body)
            except BaseException:
                conn.close()
                raise
            if conn.reusable:
                self._idle.append(conn)
            else:
                conn.close()
            return answer

    async def _connection(self) -> _Connection:
        """An idle connection the server has not closed, else a new one."""
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable:
                return conn
        loop = asyncio.get_running_loop()
        host = self.host if self.tls else None
        _, conn = await loop.create_connection(
            _Connection, self.host, self.port, ssl=self.tls, server_hostname=host
        )
        return conn

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
