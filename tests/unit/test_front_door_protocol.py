"""The front door's own HTTP/1.1 protocol (api/frontdoor.py, api/exchange.py) over a transport that keeps
what is written: bodies in pieces, 100-continue, HEAD, chunked streams, a client that leaves mid-body or
mid-stream, an app that fails, keep-alive and Connection: close. The limits (deadlines, caps, 431) are
tests/integration/test_hostile_clients.py's, over real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from inferd.api.asgi import AsgiApp, HttpRequest, HttpResponse, Router, StreamingResponse
from inferd.api.door_policy import DoorLimits, DoorPolicy
from inferd.api.frontdoor import FrontDoorProtocol, front_door_protocol
from inferd.clock import FakeClock
from inferd.core.disconnect import ClientGone, until_disconnect


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.9", 40000)}.get(name, default)

    def write(self, data: Any) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def connect(
    router: Router, limits: DoorLimits | None = None, keep_alive_s: float = 5.0
) -> tuple[FrontDoorProtocol, Transport, ServerState]:
    """The front door's protocol as uvicorn's Server builds it, with `limits`, on a fake transport."""
    app = AsgiApp(router, lambda: None, lambda request, other: HttpResponse(b"nope", 404))  # type: ignore[arg-type,return-value]
    cls = front_door_protocol(DoorPolicy(limits or DoorLimits(), FakeClock()), app)
    config = uvicorn.Config(
        app, http=cls, ws="none", log_config=None, lifespan="off", timeout_keep_alive=keep_alive_s
    )
    config.load()
    state = ServerState()
    protocol = cls(config=config, server_state=state, app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport, state


def stream_router() -> Router:
    """GET /s streams two events."""
    router = Router()

    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    async def stream(request: HttpRequest) -> StreamingResponse:
        return StreamingResponse(events())

    router.add("GET", "/s", stream)
    return router


async def settle(state: ServerState) -> None:
    for _ in range(20):
        await asyncio.sleep(0)
    while state.tasks:
        await asyncio.gather(*state.tasks)


def echo_router() -> Router:
    router = Router()

    async def echo(request: HttpRequest) -> HttpResponse:
        body = b"".join([chunk async for chunk in request.chunks()])
        return HttpResponse(body, content_type=b"text/plain")

    router.add("POST", "/echo", echo)
    router.add("GET", "/echo", echo)
    router.add("HEAD", "/echo", echo)
    return router


async def test_a_body_in_pieces_is_read_whole_and_answered_in_one_write() -> None:
    protocol, transport, state = connect(echo_router())
    protocol.data_received(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello")
    await asyncio.sleep(0)
    protocol.data_received(b"world")
    await settle(state)
    head, body = bytes(transport.written).split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 10" in head
    assert body == b"helloworld"
    assert not transport.closed  # keep-alive


async def test_expect_100_continue_is_answered_when_the_body_is_first_read() -> None:
    protocol, transport, state = connect(echo_router())
    protocol.data_received(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    await asyncio.sleep(0)
    assert bytes(transport.written) == b"HTTP/1.1 100 Continue\r\n\r\n"
    protocol.data_received(b"ok")
    await settle(state)
    assert bytes(transport.written).endswith(b"\r\n\r\nok")


async def test_head_gets_the_headers_without_the_body() -> None:
    protocol, transport, state = connect(echo_router())
    protocol.data_received(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle(state)
    assert bytes(transport.written).endswith(b"content-length: 0\r\n\r\n")


async def test_http_1_0_and_connection_close_close_after_the_response() -> None:
    for request in (b"GET /echo HTTP/1.0\r\n\r\n", b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"):
        protocol, transport, state = connect(echo_router())
        protocol.data_received(request)
        await settle(state)
        assert b"connection: close\r\n" in bytes(transport.written)
        assert transport.closed


async def test_a_client_that_leaves_mid_body_fails_the_read_and_nothing_is_written() -> None:
    seen: list[str] = []
    router = Router()

    async def reader(request: HttpRequest) -> HttpResponse:
        try:
            async for _ in request.chunks():
                pass
        except ConnectionAbortedError:
            seen.append("aborted")
            raise ClientGone() from None
        return HttpResponse(b"")

    router.add("POST", "/r", reader)
    protocol, transport, state = connect(router)
    protocol.data_received(b"POST /r HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
    await asyncio.sleep(0)
    protocol.connection_lost(None)
    await settle(state)
    assert seen == ["aborted"]
    assert bytes(transport.written) == b""
    assert state.connections == set()


async def test_the_disconnect_watch_cancels_waiting_work() -> None:
    cancelled: list[bool] = []
    router = Router()

    async def waits(request: HttpRequest) -> HttpResponse:
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            await until_disconnect(request.peer, never)
        except ClientGone:
            cancelled.append(never.cancelled())
            raise
        return HttpResponse(b"")

    router.add("GET", "/w", waits)
    protocol, _, state = connect(router)
    protocol.data_received(b"GET /w HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0)
    protocol.connection_lost(None)
    await settle(state)
    assert cancelled == [True]


async def test_a_stream_is_chunked_and_ends_with_the_last_chunk() -> None:
    protocol, transport, state = connect(stream_router())
    protocol.data_received(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle(state)
    head, body = bytes(transport.written).split(b"\r\n\r\n", 1)
    assert b"transfer-encoding: chunked" in head and b"content-type: text/event-stream" in head
    assert body == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"


async def test_an_app_that_fails_gets_a_500_and_the_connection_closes() -> None:
    router = Router()

    async def broken(request: HttpRequest) -> HttpResponse:
        raise RuntimeError("bug")

    router.add("GET", "/b", broken)
    protocol, transport, state = connect(router)
    protocol.data_received(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle(state)
    assert bytes(transport.written).startswith(b"HTTP/1.1 500 Internal Server Error")
    assert transport.closed


async def test_a_header_value_with_a_line_break_is_never_written() -> None:
    router = Router()

    async def split(request: HttpRequest) -> HttpResponse:
        return HttpResponse(b"", headers=[(b"x-bad", b"a\r\nset-cookie: x")])

    router.add("GET", "/h", split)
    protocol, transport, state = connect(router)
    protocol.data_received(b"GET /h HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle(state)
    assert b"set-cookie" not in bytes(transport.written)
    assert bytes(transport.written).startswith(b"HTTP/1.1 500")


async def test_a_garbled_request_gets_a_400_and_a_close() -> None:
    protocol, transport, state = connect(echo_router())
    protocol.data_received(b"NOT HTTP\r\n\r\n")
    await settle(state)
    assert bytes(transport.written).startswith(b"HTTP/1.1 400 Bad Request")
    assert transport.closed


async def test_a_large_body_pauses_reading_until_the_app_takes_it() -> None:
    release = asyncio.Event()
    router = Router()

    async def slow(request: HttpRequest) -> HttpResponse:
        await release.wait()
        total = 0
        async for chunk in request.chunks():
            total += len(chunk)
        return HttpResponse(str(total).encode())

    router.add("POST", "/big", slow)
    protocol, transport, state = connect(router)
    size = 200_000
    protocol.data_received(b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
    protocol.data_received(b"x" * 100_000)
    await asyncio.sleep(0)
    assert transport.paused
    release.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    protocol.data_received(b"x" * 100_000)
    await settle(state)
    assert bytes(transport.written).endswith(b"\r\n\r\n200000")
