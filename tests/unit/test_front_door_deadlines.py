"""The front door's deadlines on the paths between requests (api/frontdoor.py): a pipelined request's
body, bytes between requests that begin none, and the next head after an early answer. Real loop timers,
short limits, the fake transport of test_front_door_protocol."""

from __future__ import annotations

import asyncio

from inferd.api.asgi import HttpRequest, HttpResponse, Router
from inferd.api.door_policy import DoorLimits
from tests.unit.test_front_door_protocol import Transport, connect, echo_router, settle, stream_router

SHORT = 0.05


async def closed(transport: Transport) -> None:
    """Until `transport` is closed (a deadline ran out), or fail after 2 s."""
    for _ in range(200):
        if transport.closed:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("still open")


async def test_a_pipelined_requests_body_has_a_deadline_once_it_runs() -> None:
    protocol, transport, state = connect(echo_router(), DoorLimits(body_timeout_s=SHORT))
    protocol.data_received(
        b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\nPOST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab"
    )
    await closed(transport)
    assert b"408" in bytes(transport.written)
    protocol.connection_lost(None)
    await settle(state)


async def test_blank_lines_between_requests_do_not_hold_an_idle_connection_open() -> None:
    protocol, transport, state = connect(echo_router(), DoorLimits(), keep_alive_s=SHORT * 2)
    protocol.data_received(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle(state)
    for _ in range(10):
        protocol.data_received(b"\r\n")
        await asyncio.sleep(SHORT)
    assert transport.closed


async def test_the_next_head_after_an_early_answer_has_its_deadline() -> None:
    router = Router()

    async def fast(request: HttpRequest) -> HttpResponse:
        return HttpResponse(b"early")  # its body is not read

    router.add("POST", "/fast", fast)
    protocol, transport, state = connect(router, DoorLimits(header_timeout_s=SHORT), keep_alive_s=30.0)
    protocol.data_received(b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
    await settle(state)
    assert bytes(transport.written).endswith(b"early")
    protocol.data_received(b"abcdeGET /fast HTTP/1.1\r\nHo")
    await asyncio.sleep(SHORT * 2)
    protocol.data_received(b"s")  # the head goes on, slowly
    await closed(transport)
    assert b"408" in bytes(transport.written)


def slow_router(release: asyncio.Event) -> Router:
    router = Router()

    async def slow(request: HttpRequest) -> HttpResponse:
        await release.wait()
        return HttpResponse(b"first", content_type=b"text/plain")

    router.add("GET", "/slow", slow)
    return router


async def test_a_refusal_behind_a_running_request_waits_for_its_answer() -> None:
    for follow in (b"NOT HTTP\r\n\r\n", b"GET /x HTTP/1.1\r\nX-Big: " + b"a" * 20_000):
        release = asyncio.Event()
        protocol, transport, state = connect(slow_router(release), DoorLimits(max_header_bytes=8192))
        protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0)
        protocol.data_received(follow)
        release.set()
        await settle(state)
        written = bytes(transport.written)
        assert written.startswith(b"HTTP/1.1 200 OK"), written[:60]
        assert b"connection: close" in written.split(b"first")[0]
        assert written.split(b"first", 1)[1].startswith((b"HTTP/1.1 400", b"HTTP/1.1 431"))
        assert transport.closed


async def test_the_next_head_deadline_waits_for_the_request_before_it() -> None:
    release = asyncio.Event()
    protocol, transport, state = connect(slow_router(release), DoorLimits(header_timeout_s=SHORT))
    protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\n")
    await asyncio.sleep(SHORT * 3)  # the app is slower than the head deadline: not the client's fault
    assert not transport.closed
    release.set()
    await settle(state)
    assert bytes(transport.written).startswith(b"HTTP/1.1 200 OK")
    await closed(transport)  # from the answer on, the head is the client's to finish
    assert b"408" in bytes(transport.written)


async def test_pipelined_requests_wait_while_the_client_reads_no_responses() -> None:
    protocol, transport, state = connect(echo_router(), DoorLimits())
    protocol.pause_writing()  # the transport's buffer is over its high-water mark
    protocol.data_received(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
    await asyncio.sleep(0.01)
    assert bytes(transport.written) == b""
    for answered in (1, 2):
        protocol.resume_writing()
        protocol.pause_writing()  # the response written fills it again
        await asyncio.sleep(0.01)
        assert bytes(transport.written).count(b"HTTP/1.1 200") == answered
        assert transport.paused == (answered == 1)  # nothing more is read while requests wait
    protocol.resume_writing()
    await settle(state)
    assert bytes(transport.written).count(b"HTTP/1.1 200") == 3
    assert not transport.paused


async def test_an_early_answer_is_not_held_back_by_a_body_still_coming() -> None:
    router = Router()

    async def big(request: HttpRequest) -> HttpResponse:
        return HttpResponse(b"x" * 300_000)  # its body is not read

    router.add("POST", "/big", big)
    protocol, transport, state = connect(router, DoorLimits())
    protocol.data_received(b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n")
    await asyncio.sleep(0.01)
    protocol.pause_writing()  # the client reads nothing until it has sent its body
    protocol.data_received(b"y" * 100_000)
    protocol.data_received(b"y" * 100_000)
    assert not transport.paused
    protocol.resume_writing()
    await settle(state)
    assert bytes(transport.written).endswith(b"x" * 1000)


async def test_a_refusal_waiting_behind_requests_is_not_written_when_a_shutdown_cuts_them() -> None:
    release = asyncio.Event()
    protocol, transport, state = connect(slow_router(release), DoorLimits())
    protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
    await asyncio.sleep(0)
    protocol.data_received(b"NOT HTTP\r\n\r\n")  # waits for both answers
    protocol.shutdown()  # the first answer is the last: the second request is not run
    release.set()
    await settle(state)
    written = bytes(transport.written)
    assert written.count(b"HTTP/1.1 200") == 1 and b"400" not in written
    assert transport.closed


async def test_an_answer_without_100_continue_closes_as_the_body_may_never_come() -> None:
    router = Router()

    async def refuse(request: HttpRequest) -> HttpResponse:
        return HttpResponse(b"no", 413)  # its body is not read: no 100 Continue

    router.add("POST", "/r", refuse)
    protocol, transport, state = connect(router, DoorLimits())
    protocol.data_received(
        b"POST /r HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    )
    await settle(state)
    written = bytes(transport.written)
    assert written.startswith(b"HTTP/1.1 413") and b"connection: close" in written
    assert transport.closed  # else the client's next request would be read as this one's body


async def test_a_refusal_at_the_door_without_100_continue_closes() -> None:
    protocol, transport, state = connect(
        echo_router(), DoorLimits(admission_rate_per_s=0.001, admission_burst=1)
    )
    protocol.data_received(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle(state)
    protocol.data_received(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    )
    await settle(state)
    written = bytes(transport.written)
    assert b"HTTP/1.1 429" in written and written.endswith(b"}") and b"connection: close" in written
    assert transport.closed


async def test_a_stream_to_an_http_1_0_client_is_not_chunked_and_ends_with_the_close() -> None:
    protocol, transport, state = connect(stream_router(), DoorLimits())
    protocol.data_received(b"GET /s HTTP/1.0\r\n\r\n")  # 1.0 has no chunked encoding
    await settle(state)
    head, body = bytes(transport.written).split(b"\r\n\r\n", 1)
    assert b"transfer-encoding" not in head and b"connection: close" in head
    assert body == b"data: 1\n\ndata: 2\n\n"
    assert transport.closed


class EofTransport(Transport):
    def __init__(self) -> None:
        super().__init__()
        self.eof = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True


async def test_a_close_while_the_body_still_comes_ends_gracefully() -> None:
    router = Router()

    async def refuse(request: HttpRequest) -> HttpResponse:
        return HttpResponse(b"too big", 413, headers=[(b"connection", b"close")])  # its body unread

    router.add("POST", "/r", refuse)
    protocol, _, state = connect(router, DoorLimits())
    transport = EofTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"POST /r HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nabc")
    await settle(state)
    assert bytes(transport.written).endswith(b"too big")
    assert transport.eof and not transport.closed  # what the client still sends is read, not reset
    protocol.data_received(b"x" * 50_000)  # and dropped
    protocol.connection_lost(None)


async def test_a_pipelined_refusal_that_closes_says_so() -> None:
    release = asyncio.Event()
    limits = DoorLimits(admission_rate_per_s=0.001, admission_burst=1)
    protocol, transport, state = connect(slow_router(release), limits)
    protocol.data_received(
        b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    release.set()
    await settle(state)
    second = bytes(transport.written).split(b"first", 1)[1]
    assert second.startswith(b"HTTP/1.1 429") and b"connection: close" in second
    assert transport.closed


async def test_the_400_carries_the_date_and_server_headers_as_uvicorns_did() -> None:
    protocol, transport, state = connect(echo_router(), DoorLimits())
    state.default_headers = [(b"date", b"Fri, 04 Dec 2026 20:00:00 GMT"), (b"server", b"uvicorn")]
    protocol.data_received(b"NOT HTTP\r\n\r\n")
    written = bytes(transport.written)
    assert written.startswith(b"HTTP/1.1 400 Bad Request\r\ndate: Fri, 04 Dec 2026 20:00:00 GMT\r\n")
    assert b"server: uvicorn\r\n" in written and written.endswith(b"\r\n\r\nInvalid HTTP request received.")


async def test_an_http_1_0_expectation_of_100_continue_is_ignored() -> None:
    protocol, transport, state = connect(echo_router(), DoorLimits())
    protocol.data_received(b"POST /echo HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok")
    await settle(state)
    written = bytes(transport.written)
    assert written.startswith(b"HTTP/1.1 200 OK") and written.endswith(b"\r\n\r\nok")
