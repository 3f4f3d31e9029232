"""The load generator's HTTP client against a scripted local server: answers are read by their
Content-Length (however the bytes arrive), connections are kept and reused, and one the server
closes is not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from inferd.search.bench_http import HttpError, HttpPool


class Scripted:
    """Answers each request (read up to its body) with the next scripted reply, in pieces; closes the
    connection when the script runs out."""

    def __init__(self, replies: list[list[bytes]]) -> None:
        self.replies = replies
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.replies.pop(0):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[tuple[Scripted, str]]:
    scripted = Scripted([])
    srv = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    yield scripted, f"http://127.0.0.1:{port}"
    srv.close()


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_answers_are_read_by_length_and_the_connection_is_reused(server) -> None:
    scripted, url = server
    whole = _ok(b'{"hits": []}')
    scripted.replies += [
        [whole[:10], whole[10:30], whole[30:]],
        [b"HTTP/1.1 503 Busy\r\ncontent-length: 2\r\n\r\n{}"],
    ]
    pool = HttpPool(url)
    assert await pool.post("/v1/indexes/x/search", b'{"query": "a"}') == (200, b'{"hits": []}')
    assert await pool.post("/v1/indexes/x/search", b"{}") == (503, b"{}")
    assert scripted.connections == 1
    assert scripted.requests[0].startswith(b"POST /v1/indexes/x/search HTTP/1.1\r\n")
    assert scripted.requests[0].endswith(b'\r\n\r\n{"query": "a"}')
    pool.close()


async def test_a_connection_the_server_closes_is_not_reused(server) -> None:
    scripted, url = server
    scripted.replies += [[_ok(b"1", b"connection: close\r\n")], [_ok(b"2")]]
    pool = HttpPool(url)
    assert await pool.post("/s", b"{}") == (200, b"1")
    assert await pool.post("/s", b"{}") == (200, b"2")
    assert scripted.connections == 2
    pool.close()


async def test_an_answer_without_length_or_cut_short_is_an_error(server) -> None:
    scripted, url = server
    scripted.replies += [[b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"]]
    pool = HttpPool(url)
    with pytest.raises(HttpError):
        await pool.post("/s", b"{}")
    scripted.replies += [[b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort"]]
    with pytest.raises(HttpError):  # the server closes after its script: the body never completes
        await pool.post("/s", b"{}")
    pool.close()
