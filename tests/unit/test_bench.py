"""`inferd bench` against an in-process stub of the OIP v2 infer endpoint.

The stub answers like the server (sim_digest of the payload, lifecycle headers) and misbehaves on
command for chosen request numbers: 429s, wrong digests, another caller's id, slow answers, or a
stalled event loop (which also stalls the generator, proving latency counts from intended time).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import typer
from aiohttp import web
from typer.testing import CliRunner

from inferd.bench.http_clients import RawClient
from inferd.bench.infer_requests import payload_for, request_body, request_id
from inferd.bench.loadgen import LoadSpec, run_load
from inferd.bench.open_loop import arrival_offsets
from inferd.bench.spec_checks import parse_header
from inferd.cli.bench_cmd import bench
from inferd.models.sim import sim_digest

Rule = Callable[[int], bool]


def never(i: int) -> bool:
    return False


@dataclass
class StubBehaviour:
    """Which request numbers (i in id "seed-i") get which misbehaviour."""

    reject_429: Rule = never
    wrong_digest: Rule = never
    foreign_id: Rule = never
    """Answer with the id of request i + foreign_offset instead of i."""
    foreign_offset: int = -1
    slow: Rule = never
    slow_s: float = 0.0
    stall_loop: Rule = never
    """Block the event loop (server and generator share it) for stall_s."""
    stall_s: float = 0.0
    delay_s: float = 0.0
    close_conn: Rule = never
    """Answer, then close the connection (`Connection: close`)."""
    headers: dict[str, str] = field(
        default_factory=lambda: {
            "X-Inferd-Queue-Ms": "5.0",
            "X-Inferd-Compute-Ms": "2.0",
            "X-Inferd-Batch-Size": "8",
            "X-Inferd-Batch-Id": "1",
            "X-Inferd-Attempts": "1",
        }
    )
    received: int = 0
    peers: set[tuple[str, int]] = field(default_factory=set)
    """Client (host, port) pairs seen: how many connections the generator used."""


def make_app(behaviour: StubBehaviour) -> web.Application:
    async def infer(request: web.Request) -> web.Response:
        behaviour.received += 1
        if request.transport is not None:
            behaviour.peers.add(request.transport.get_extra_info("peername")[:2])
        body = await request.json()
        rid = body["id"]
        payload = body["inputs"][0]["data"][0]
        i = int(rid.rsplit("-", 1)[1])
        if behaviour.stall_loop(i):
            time.sleep(behaviour.stall_s)  # noqa: ASYNC251 -- deliberately stalls the shared loop
        if behaviour.slow(i):
            await asyncio.sleep(behaviour.slow_s)
        elif behaviour.delay_s:
            await asyncio.sleep(behaviour.delay_s)
        if behaviour.reject_429(i):
            return web.json_response({"error": "queue full"}, status=429, headers={"Retry-After": "1"})
        model = request.match_info["model"]
        digest = sim_digest(model, 1, payload)
        if behaviour.wrong_digest(i):
            digest = sim_digest(model, 1, payload + "other")
        if behaviour.foreign_id(i):
            rid = f"{rid.rsplit('-', 1)[0]}-{i + behaviour.foreign_offset}"
        answer = {
            "model_name": model,
            "model_version": "1",
            "id": rid,
            "outputs": [{"name": "OUTPUT0", "datatype": "BYTES", "shape": [1], "data": [digest]}],
            "parameters": {},
        }
        response = web.json_response(answer, headers=behaviour.headers)
        if behaviour.close_conn(i):
            response.force_close()
        return response

    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", infer)
    return app


@dataclass
class Stub:
    url: str
    behaviour: StubBehaviour


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    behaviour = StubBehaviour()
    runner = web.AppRunner(make_app(behaviour), handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield Stub(url=f"http://127.0.0.1:{port}", behaviour=behaviour)
    await runner.cleanup()
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert leftover == [], f"tasks left running: {leftover}"


@pytest.fixture(params=["raw", "aiohttp"])
def client(request: pytest.FixtureRequest) -> str:
    """Both HTTP clients, for the tests that must hold for either."""
    return request.param


def spec(url: str, **overrides: object) -> LoadSpec:
    base: dict[str, object] = {"url": url, "rate": 200.0, "duration_s": 0.5, "arrival": "constant"}
    return LoadSpec(**(base | overrides))  # type: ignore[arg-type]


# --- schedule (no network) ---


def test_constant_arrivals_are_evenly_spaced_over_warmup_and_duration() -> None:
    offsets = arrival_offsets(LoadSpec(rate=100.0, duration_s=1.0, warmup_s=0.5, arrival="constant"))
    assert len(offsets) == 150
    assert offsets[:3] == [0.0, 0.01, 0.02]
    assert offsets[-1] < 1.5


def test_poisson_arrivals_are_seeded_and_near_the_offered_rate() -> None:
    s = LoadSpec(rate=2000.0, duration_s=5.0, arrival="poisson", seed=7)
    offsets = arrival_offsets(s)
    assert offsets == arrival_offsets(s)
    assert offsets != arrival_offsets(LoadSpec(rate=2000.0, duration_s=5.0, seed=8))
    assert 9_500 < len(offsets) < 10_500  # Poisson(10,000): sd 100
    assert all(a < b for a, b in itertools.pairwise(offsets))
    assert 0.0 <= offsets[0] and offsets[-1] < 5.0


def test_max_requests_caps_both_arrival_processes() -> None:
    for arrival in ("poisson", "constant"):
        assert (
            len(arrival_offsets(LoadSpec(rate=1000.0, duration_s=5.0, arrival=arrival, max_requests=42)))
            == 42
        )


def test_payloads_are_unique_and_padded_to_size() -> None:
    payloads = {payload_for(3, i, 24) for i in range(1000)}
    assert len(payloads) == 1000
    assert {len(p) for p in payloads} == {24}
    assert payload_for(3, 12345, 4) == "3-12345-"  # never truncated: uniqueness wins


def test_invalid_spec_names_the_bad_values() -> None:
    with pytest.raises(ValueError, match="rate must be > 0"):
        LoadSpec(rate=0.0)
    with pytest.raises(ValueError, match="client must be"):
        LoadSpec(client="curl")  # type: ignore[arg-type]


def test_raw_client_needs_a_plain_http_url() -> None:
    for url in ("https://127.0.0.1:8443", "127.0.0.1:8000", "http://127.0.0.1:notaport", "http://"):
        with pytest.raises(ValueError, match="raw client needs an http:// url"):
            LoadSpec(url=url)
    LoadSpec(url="https://127.0.0.1:8443", client="aiohttp")  # aiohttp speaks TLS
    LoadSpec(url="http://[::1]:8000/prefix/")


# --- against the stub ---


async def test_correct_answers_are_ok_with_lifecycle_summary(stub: Stub, client: str) -> None:
    report = await run_load(spec(stub.url, client=client))
    m = report.measured
    assert report.spec["client"] == client
    assert (report.scheduled, report.sent, m.sent, m.ok) == (100, 100, 100, 100)
    assert m.mismatched == 0 and m.errors == {}
    assert m.offered_rps == pytest.approx(200.0)
    assert m.achieved_rps == pytest.approx(200.0)
    assert m.queue_ms["mean"] == pytest.approx(5.0, rel=0.01)
    assert m.compute_ms["p50"] == pytest.approx(2.0, rel=0.01)
    assert m.batch_size["mean"] == pytest.approx(8.0)
    assert m.latency_ms["p50"] is not None and m.latency_ms["p50"] < 50.0
    assert report.cpu_us_per_request > 0
    assert report.to_dict()["measured"]["ok"] == 100


async def test_rejections_are_counted_by_status_not_as_ok(stub: Stub, client: str) -> None:
    stub.behaviour.reject_429 = lambda i: i % 4 == 0
    m = (await run_load(spec(stub.url, client=client))).measured
    assert (m.ok, m.errors, m.mismatched) == (75, {"http_429": 25}, 0)


async def test_wrong_digest_is_caught_as_mismatched(stub: Stub, client: str) -> None:
    stub.behaviour.wrong_digest = lambda i: i % 10 == 3
    report = await run_load(spec(stub.url, client=client))
    m = report.measured
    assert (m.ok, m.mismatched) == (90, 10)
    assert m.mismatch_kinds == {"wrong_id": 0, "unknown_id": 0, "wrong_digest": 10}
    assert report.mismatched_total == 10


async def test_answer_carrying_an_id_no_longer_outstanding_is_caught(stub: Stub) -> None:
    # Without delay, request i - 1 has already been answered when i is.
    stub.behaviour.foreign_id = lambda i: i % 5 == 1
    m = (await run_load(spec(stub.url))).measured
    assert (m.ok, m.mismatched) == (80, 20)
    assert m.mismatch_kinds == {"wrong_id": 0, "unknown_id": 20, "wrong_digest": 0}


async def test_answer_carrying_another_outstanding_callers_id_is_wrong_id(stub: Stub, client: str) -> None:
    # Every request waits 200 ms at 200 req/s, so request i + 1 is still outstanding when i is answered.
    stub.behaviour.delay_s = 0.2
    stub.behaviour.foreign_offset = 1
    stub.behaviour.foreign_id = lambda i: i % 5 == 1
    m = (await run_load(spec(stub.url, client=client))).measured
    assert (m.ok, m.mismatched) == (80, 20)
    # On a loaded machine the other caller may already be answered: then the id is unknown, not another
    # outstanding caller's. Either way it is counted as misrouted, never as ok.
    assert m.mismatch_kinds["wrong_id"] + m.mismatch_kinds["unknown_id"] == 20
    assert m.mismatch_kinds["wrong_id"] >= 15 and m.mismatch_kinds["wrong_digest"] == 0


async def test_latency_reflects_injected_server_delay(stub: Stub) -> None:
    stub.behaviour.delay_s = 0.1
    m = (await run_load(spec(stub.url, duration_s=0.25))).measured
    assert m.ok == 50
    assert 100.0 <= m.latency_ms["p50"] < 400.0  # type: ignore[operator]
    assert m.overhead_ms["p50"] > 90.0  # type: ignore[operator]  # stub claims only 7 ms queue+compute


async def test_slow_answers_past_the_client_deadline_count_as_timeouts(stub: Stub, client: str) -> None:
    stub.behaviour.slow = lambda i: i % 4 == 0
    stub.behaviour.slow_s = 5.0
    started = time.monotonic()
    m = (await run_load(spec(stub.url, duration_s=0.25, timeout_ms=300.0, client=client))).measured
    assert (m.ok, m.errors) == (37, {"timeout": 13})
    assert m.latency_ms["max"] < 300.0  # type: ignore[operator]
    assert time.monotonic() - started < 2.0


async def test_latency_counts_from_intended_send_time_when_the_generator_stalls(stub: Stub) -> None:
    # Request 10 blocks the loop for 300 ms: requests intended during the stall are sent late, and
    # their latency must include the stall (a closed-loop or send-time clock would hide it).
    stub.behaviour.stall_loop = lambda i: i == 10
    stub.behaviour.stall_s = 0.3
    m = (await run_load(spec(stub.url, rate=100.0, duration_s=1.0))).measured
    assert m.ok == 100
    assert m.send_lag_ms["max"] > 200.0  # type: ignore[operator]
    assert m.latency_ms["p90"] > 150.0  # type: ignore[operator]  # ~30 of 100 waited out the stall
    assert m.latency_ms["p50"] < 50.0  # type: ignore[operator]


async def test_warmup_results_are_reported_apart(stub: Stub) -> None:
    stub.behaviour.wrong_digest = lambda i: i == 0
    report = await run_load(spec(stub.url, warmup_s=0.2, duration_s=0.3))
    assert report.warmup is not None
    assert (report.warmup.sent, report.warmup.mismatched) == (40, 1)
    assert (report.measured.sent, report.measured.ok, report.measured.mismatched) == (60, 60, 0)
    assert report.mismatched_total == 1


async def test_refused_connections_are_counted_as_connection_errors(client: str) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()  # nothing listens on `port` now
    m = (await run_load(spec(f"http://127.0.0.1:{port}", duration_s=0.1, client=client))).measured
    assert (m.ok, m.errors) == (0, {"connection": 20})


async def test_goodput_counts_only_answers_within_the_slo(stub: Stub) -> None:
    stub.behaviour.slow = lambda i: i % 2 == 0
    stub.behaviour.slow_s = 0.6  # far past the SLO; the fast answers have 300 ms of margin on a busy machine
    m = (await run_load(spec(stub.url, duration_s=0.25, slo_ms=300.0))).measured
    assert m.ok == 50
    assert m.goodput_rps == pytest.approx(25 / 0.25)


# --- the raw client: keep-alive pool, closing servers, deadlines, odd framing ---


async def test_raw_client_keeps_connections_alive(stub: Stub) -> None:
    m = (await run_load(spec(stub.url))).measured
    assert m.ok == 100
    # 200 req/s of ~1 ms answers: a few connections, reused (a handful on a quiet machine; a loaded one
    # lets more requests overlap, so a new connection now and then: still far fewer than requests)
    assert len(stub.behaviour.peers) <= 12


async def test_raw_client_reconnects_when_the_server_closes_connections(stub: Stub) -> None:
    stub.behaviour.close_conn = lambda i: i % 3 == 0
    m = (await run_load(spec(stub.url))).measured
    assert (m.ok, m.errors, m.mismatched) == (100, {}, 0)
    assert len(stub.behaviour.peers) >= 34  # every third answer closed its connection


async def test_raw_client_waits_for_a_connection_at_the_limit(stub: Stub) -> None:
    # 2 connections, 50 ms answers: capacity 40 req/s against 200 offered. Every request is answered in
    # turn, and the time spent waiting for a connection counts in its latency.
    stub.behaviour.delay_s = 0.05
    m = (await run_load(spec(stub.url, duration_s=0.25, connections=2))).measured
    assert (m.ok, m.errors) == (50, {})
    assert len(stub.behaviour.peers) == 2
    assert m.latency_ms["max"] > 900.0  # type: ignore[operator]  # the last one waited ~1.2 s


async def test_raw_client_never_reads_a_late_answer_as_the_next_requests(stub: Stub) -> None:
    # Every 4th answer comes 100 ms past the 150 ms deadline. Its connection must be closed at the
    # deadline: reused, the next request on it would read the late answer (another caller's id).
    stub.behaviour.slow = lambda i: i % 4 == 0
    stub.behaviour.slow_s = 0.25
    m = (await run_load(spec(stub.url, timeout_ms=150.0, connections=1))).measured
    assert m.mismatched == 0
    assert m.errors["timeout"] >= 25
    assert m.ok + m.errors["timeout"] == 100


async def test_raw_client_deadline_covers_waiting_for_a_connection(stub: Stub) -> None:
    stub.behaviour.delay_s = 0.5
    started = time.monotonic()
    m = (await run_load(spec(stub.url, duration_s=0.1, timeout_ms=200.0, connections=1))).measured
    assert (m.ok, m.errors) == (0, {"timeout": 20})
    assert time.monotonic() - started < 1.5


@dataclass
class RawServer:
    url: str
    requests: list[bytes]


Reply = Callable[[int, bytes], tuple[bytes, bool]]
"""(request number, request body) -> (bytes to send, close the connection after)."""


def ok_answer(body: bytes) -> bytes:
    request = json.loads(body)
    payload = request["inputs"][0]["data"][0]
    output = {"name": "OUTPUT0", "datatype": "BYTES", "shape": [1], "data": [sim_digest("sim", 1, payload)]}
    answer = {"model_name": "sim", "model_version": "1", "id": request["id"], "outputs": [output]}
    return json.dumps(answer).encode()


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[Reply], Awaitable[RawServer]]]:
    """A hand-rolled HTTP/1.1 server that sends exactly the bytes a test scripts."""
    servers: list[asyncio.Server] = []
    writers: list[asyncio.StreamWriter] = []

    async def start(reply: Reply) -> RawServer:
        seen: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    body = await reader.readexactly(length)
                    seen.append(head + body)
                    data, close = reply(len(seen) - 1, body)
                    writer.write(data)
                    await writer.drain()
                    if close:
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return RawServer(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen)

    yield start
    for writer in writers:
        writer.close()
    for server in servers:
        server.close()
        await server.wait_closed()
    await asyncio.sleep(0.01)  # let the handlers finish


def http_response(body: bytes, *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return f"HTTP/1.1 200 OK\r\n{head}\r\n".encode() + body


async def post_once(url: str, i: int = 0) -> tuple[int, Mapping[str, str], bytes]:
    raw = RawClient.for_spec(spec(url), time.monotonic)
    await raw.start()
    try:
        body = request_body(request_id(0, i), payload_for(0, i, 32))
        return await raw.post(body, time.monotonic() + 5.0)
    finally:
        await raw.close()


async def test_raw_client_reads_chunked_and_until_close_bodies(raw_server: Callable[..., Any]) -> None:
    def chunked(i: int, body: bytes) -> tuple[bytes, bool]:
        answer = ok_answer(body)
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (answer[:10], answer[10:]))
        headers = ("Transfer-Encoding: chunked", "x-inferd-queue-ms: 1.5", "RETRY-AFTER: 2")
        return http_response(chunks + b"0\r\n\r\n", *headers), False

    def until_close(i: int, body: bytes) -> tuple[bytes, bool]:
        return http_response(ok_answer(body), "Connection: close"), True

    server = await raw_server(chunked)
    status, headers, body = await post_once(server.url)
    assert status == 200
    assert json.loads(body)["id"] == "0-0"
    assert headers == {"X-Inferd-Queue-Ms": "1.5", "Retry-After": "2"}  # names as the engine spells them
    request = server.requests[0]
    assert request.startswith(b"POST /v2/models/sim/infer HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Content-Type: application/json\r\n" in request

    server = await raw_server(until_close)
    status, _, body = await post_once(server.url, 7)
    assert (status, json.loads(body)["id"]) == (200, "0-7")

    m = (await run_load(spec(server.url, duration_s=0.1))).measured
    assert (m.ok, m.errors) == (20, {})


async def test_raw_client_counts_resets_and_garbage_as_connection_errors(
    raw_server: Callable[..., Any],
) -> None:
    def flaky(i: int, body: bytes) -> tuple[bytes, bool]:
        if i % 5 == 1:
            return b"", True  # hang up without answering
        if i % 5 == 2:
            return b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{", True  # truncated body
        if i % 5 == 3:
            return b"SPDY/9 banana\r\n\r\n", True  # not HTTP
        answer = ok_answer(body)
        return http_response(answer, f"Content-Length: {len(answer)}"), False

    server = await raw_server(flaky)
    m = (await run_load(spec(server.url, duration_s=0.25))).measured
    assert (m.ok, m.errors, m.mismatched) == (20, {"connection": 30}, 0)
    assert len(server.requests) == 50


async def test_raw_client_sends_priority_and_remaining_deadline(raw_server: Callable[..., Any]) -> None:
    def reply(i: int, body: bytes) -> tuple[bytes, bool]:
        answer = ok_answer(body)
        return http_response(answer, f"Content-Length: {len(answer)}"), False

    server = await raw_server(reply)
    s = spec(server.url, duration_s=0.05, priority="high", send_deadline=True, timeout_ms=800.0)
    m = (await run_load(s)).measured
    assert m.ok == 10
    for request in server.requests:
        assert b"\r\nX-Priority: high\r\n" in request
        remaining = int(request.split(b"X-Request-Timeout-Ms: ")[1].split(b"\r\n")[0])
        assert 700 <= remaining <= 800


async def test_raw_client_sends_extra_headers(raw_server: Callable[..., Any]) -> None:
    def reply(i: int, body: bytes) -> tuple[bytes, bool]:
        answer = ok_answer(body)
        return http_response(answer, f"Content-Length: {len(answer)}"), False

    server = await raw_server(reply)
    s = spec(server.url, duration_s=0.05, headers=(("Authorization", "Bearer ik-x"),))
    assert (await run_load(s)).measured.ok == 10
    assert all(b"\r\nAuthorization: Bearer ik-x\r\n" in r for r in server.requests)


def test_header_option_needs_name_and_value() -> None:
    assert parse_header("Authorization: Bearer k") == ("Authorization", "Bearer k")
    assert parse_header("X-A:b") == ("X-A", "b")
    with pytest.raises(ValueError, match="no colon"):
        parse_header("no-colon")
    with pytest.raises(ValueError, match="CR or LF"):
        LoadSpec(headers=(("X-A", "b\r\nEvil: 1"),))


# --- the command ---


@pytest.fixture
def threaded_stub() -> Iterator[Stub]:
    """The stub on its own loop in a thread, for the blocking CLI."""
    behaviour = StubBehaviour()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(behaviour), handler_cancellation=True, shutdown_timeout=0.5)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner.addresses[0][1]

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=5)
    try:
        yield Stub(url=f"http://127.0.0.1:{port}", behaviour=behaviour)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command("bench")(bench)
    return app


def test_help_explains_every_option() -> None:
    result = CliRunner().invoke(cli(), ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in (
        "--url",
        "--model",
        "--rate",
        "--duration",
        "--warmup",
        "--arrival",
        "--timeout-ms",
        "--send-deadline",
        "--payload-bytes",
        "--max-requests",
        "--seed",
        "--connections",
        "--client",
        "--json",
    ):
        assert option in result.output


def test_command_prints_json_and_exits_zero_when_all_answers_match(threaded_stub: Stub) -> None:
    args = [
        "--url",
        threaded_stub.url,
        "--rate",
        "200",
        "--duration",
        "0.2",
        "--arrival",
        "constant",
        "--json",
    ]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["measured"]["ok"] == 40
    assert data["mismatched_total"] == 0


def test_command_can_use_the_aiohttp_client(threaded_stub: Stub) -> None:
    args = ["--url", threaded_stub.url, "--rate", "200", "--duration", "0.2", "--client", "aiohttp"]
    result = CliRunner().invoke(cli(), [*args, "--arrival", "constant", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["spec"]["client"], data["measured"]["ok"]) == ("aiohttp", 40)


def test_command_exits_nonzero_when_an_answer_is_mismatched(threaded_stub: Stub) -> None:
    threaded_stub.behaviour.wrong_digest = lambda i: i == 5
    args = ["--url", threaded_stub.url, "--rate", "200", "--duration", "0.2", "--arrival", "constant"]
    result = CliRunner().invoke(cli(), args, env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "mismatched" in result.output


def test_request_ids_are_unique_per_request() -> None:
    assert len({request_id(0, i) for i in range(1000)}) == 1000


def test_gamma_arrivals_are_bursty_and_the_simulators_own():
    import numpy as np

    from inferd.bench.open_loop import arrival_offsets
    from inferd.fleetsim.arrivals import ArrivalSpec, arrival_times

    spec = LoadSpec(rate=500.0, duration_s=20.0, arrival="gamma", arrival_cv=3.0, seed=7)
    offsets = np.array(arrival_offsets(spec))
    gaps = np.diff(offsets)
    assert 2.5 < gaps.std() / gaps.mean() < 3.5
    assert len(offsets) == pytest.approx(10_000, rel=0.15)
    assert np.array_equal(offsets, arrival_times(ArrivalSpec("gamma", 500.0, 3.0, seed=7), 20.0))
    with pytest.raises(ValueError, match="arrival_cv must be > 0"):
        LoadSpec(arrival="gamma", arrival_cv=0.0)
