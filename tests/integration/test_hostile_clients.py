"""The front door against hostile clients, on a real `inferd serve`: slow heads and bodies are cut off
at their deadlines while normal clients are served, heads over the limits get 431, and connections and
requests past the caps are refused at once with 429, none left waiting."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from inferd.models.sim import sim_digest
from tests.conftest import ServerProc, start_server

HEAD_TIMEOUT_S = 2.0
PER_IP = 8


def serve(tmp: Path, config: str) -> ServerProc:
    path = tmp / "inferd.toml"
    path.write_text("[server]\n" + config)
    return start_server(tmp, "--model", "sim", "--no-admin", "--config", str(path))


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = serve(
        tmp_path_factory.mktemp("slow"),
        f"header_timeout_s = {HEAD_TIMEOUT_S}\nbody_timeout_s = 2.0\nmax_header_bytes = 4096\n"
        f"max_header_count = 20\nmax_connections_per_ip = {PER_IP}\n",
    )
    yield s
    assert s.stop() in (0, -15)
    assert not re.search("Traceback|Fatal error|Invalid HTTP", s.log()), s.log()[-3000:]


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = serve(
        tmp_path_factory.mktemp("capped"),
        "max_connections = 64\nadmission_rate_per_s = 20.0\nadmission_burst = 20\nbody_timeout_s = 2.0\n",
    )
    yield s
    assert s.stop() in (0, -15)
    assert not re.search("Traceback|Fatal error|Invalid HTTP", s.log()), s.log()[-3000:]


def infer_json(text: str) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}


def infer_head(port: int, body: bytes, close: bool = True) -> bytes:
    return (
        f"POST /v2/models/sim/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        + ("Connection: close\r\n" if close else "")
        + "\r\n"
    ).encode()


async def read_to_eof(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the server sends until it closes; raises TimeoutError if it does not close in time."""
    async with asyncio.timeout(timeout_s):
        return await reader.read()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    """One response with a Content-Length from a keep-alive connection: status, head, body."""
    async with asyncio.timeout(15):
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
        assert length is not None, head
        return status_of(head), head, await reader.readexactly(int(length.group(1)))


def status_of(response: bytes) -> int:
    """The status of the one response in `response` (0 when there is none, or more than one)."""
    if not response.startswith(b"HTTP/1.1 ") or response.count(b"HTTP/1.1 ") > 1:
        return 0
    return int(response.split(b" ", 2)[1])


async def trickle(ip: str, port: int, stop_at: float) -> bytes:
    """A slowloris: a request head one header line every 0.5 s, from `ip`; what the server sent back
    when it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ip, 0))
    try:
        writer.write(b"POST /v2/models/sim/infer HTTP/1.1\r\nHost: x\r\n")
        got = b""
        for i in range(1000):
            if time.monotonic() > stop_at:
                raise AssertionError(f"a trickling connection from {ip} was still open at the end")
            try:
                writer.write(b"X-Slow-%d: y\r\n" % i)
                await writer.drain()
            except ConnectionError:
                return got
            try:
                async with asyncio.timeout(0.5):
                    chunk = await reader.read(65536)
            except TimeoutError:
                continue
            if not chunk:
                return got
            got += chunk
        return got
    finally:
        writer.close()


async def normal_client(http: aiohttp.ClientSession, url: str, name: str, until: asyncio.Event) -> int:
    """Requests one after another until `until` is set; each must get 200 with its own answer."""
    n = 0
    while not until.is_set() and n < 2000:
        text = f"{name}-{n}"
        async with http.post(f"{url}/v2/models/sim/infer", json=infer_json(text)) as r:
            assert r.status == 200, await r.text()
            body = await r.json()
        assert body["outputs"][0]["data"] == [sim_digest("sim", 1, text)]
        n += 1
    return n


async def test_trickling_heads_are_cut_at_the_head_deadline_while_normal_clients_are_served(
    slow_server: ServerProc,
) -> None:
    stop_at = time.monotonic() + HEAD_TIMEOUT_S + 25.0
    addresses = [f"127.0.0.{2 + i % 254}" for i in range(500)]
    done = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(limit=4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async with asyncio.TaskGroup() as tg:
            normal = [tg.create_task(normal_client(http, slow_server.url, f"n{i}", done)) for i in range(4)]
            attackers = [tg.create_task(trickle(ip, slow_server.port, stop_at)) for ip in addresses]
            try:
                answers = await asyncio.gather(*attackers)
            finally:
                done.set()
    statuses = [status_of(a) for a in answers]
    assert statuses == [408] * 500, f"trickling connections got {sorted(set(statuses))}"
    assert all(t.result() > 0 for t in normal), [t.result() for t in normal]


async def test_a_client_address_past_its_connection_cap_gets_429_and_the_others_are_unaffected(
    slow_server: ServerProc,
) -> None:
    ip, port = "127.0.1.7", slow_server.port
    held = [await asyncio.open_connection("127.0.0.1", port, local_addr=(ip, 0)) for _ in range(PER_IP)]
    try:
        for reader, writer in held:  # an answer on each: the server has counted all of them
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(10):
                assert status_of(await reader.readuntil(b"\r\n\r\n")) == 200
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ip, 0))
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        refused = await read_to_eof(reader, 10)
        writer.close()
        assert status_of(refused) == 429, refused
        assert b"retry-after: 1\r\n" in refused and b"connection: close" in refused
        assert b"too many connections from 127.0.1.7" in refused
        other, owriter = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.1.8", 0))
        owriter.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status_of(await read_to_eof(other, 10)) == 200
        owriter.close()
    finally:
        for _, writer in held:
            writer.close()


async def raw_exchange(port: int, data: bytes, timeout_s: float = 15.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await read_to_eof(reader, timeout_s)
    finally:
        writer.close()


async def test_heads_over_the_size_or_line_limits_get_431(slow_server: ServerProc) -> None:
    port = slow_server.port
    big = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n"
    many = b"GET /v2/health/live HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(30)) + b"\r\n"
    unfinished = b"GET /v2/health/live HTTP/1.1\r\nX-Endless: " + b"a" * 8000  # no end of line
    for head in (big, many, unfinished):
        answer = await raw_exchange(port, head)
        assert status_of(answer) == 431, answer[:200]
        assert b"request head too large" in answer


async def test_pipelined_requests_with_bodies_larger_than_the_head_limit_are_served(
    slow_server: ServerProc,
) -> None:
    port = slow_server.port
    texts = [f"{i}" * 20_000 for i in range(3)]
    bodies = [json.dumps(infer_json(t)).encode() for t in texts]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        data = b"".join(infer_head(port, b, close=False) + b for b in bodies)
        split = len(data) - len(bodies[-1]) - 40  # the first read ends inside the last request's head
        writer.write(data[:split])
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(data[split:])
        for text in texts:
            status, _, answer = await read_response(reader)
            assert status == 200, answer[:200]
            assert json.loads(answer)["outputs"][0]["data"] == [sim_digest("sim", 1, text)]
    finally:
        writer.close()


async def test_a_slow_body_gets_408_at_the_body_deadline(slow_server: ServerProc) -> None:
    head = infer_head(slow_server.port, b"x" * 100, close=False)
    answer = await raw_exchange(slow_server.port, head + b"{" * 10)
    assert status_of(answer) == 408, answer[:200]
    assert b"request body not complete within 2 s" in answer


async def test_a_silent_connection_is_closed_and_a_keep_alive_one_gets_408_on_a_stalled_next_head(
    slow_server: ServerProc,
) -> None:
    assert await raw_exchange(slow_server.port, b"") == b""  # nothing sent, nothing answered: closed
    reader, writer = await asyncio.open_connection("127.0.0.1", slow_server.port)
    try:
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        answer = await read_to_eof(reader, 15)
    finally:
        writer.close()
    assert b"HTTP/1.1 408 " in answer, answer


async def one_request(port: int, i: int) -> tuple[int, bytes]:
    body = f'{{"inputs":[{{"name":"INPUT0","shape":[1],"datatype":"BYTES","data":["c{i}"]}}]}}'.encode()
    answer = await raw_exchange(port, infer_head(port, body) + body, timeout_s=30)
    return status_of(answer), answer


async def test_ten_times_the_connection_cap_at_once_gets_answers_never_timeouts(
    capped_server: ServerProc,
) -> None:
    results = await asyncio.gather(*(one_request(capped_server.port, i) for i in range(640)))
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert statuses.count(200) >= 1
    refused = [a for s, a in results if s == 429]
    assert any(b"too many connections: " in a for a in refused), "no refusal at the connection cap"
    assert all(b"retry-after: " in a for a in refused)
    for i, (status, answer) in enumerate(results):
        if status == 200:
            assert sim_digest("sim", 1, f"c{i}").encode() in answer


async def test_requests_over_the_admission_rate_get_429_with_an_honest_retry_after(
    capped_server: ServerProc,
) -> None:
    connector = aiohttp.TCPConnector(limit=8)
    statuses: list[int] = []
    waits_ms: list[float] = []
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector) as http:

        async def call(i: int) -> None:
            async with http.post(f"{capped_server.url}/v2/models/sim/infer", json=infer_json(f"r{i}")) as r:
                statuses.append(r.status)
                if r.status == 429:
                    assert "admission rate" in (await r.json())["error"]
                    assert int(r.headers["Retry-After"]) >= 1
                    waits_ms.append(float(r.headers["X-Inferd-Retry-After-Ms"]))
                else:
                    assert (await r.json())["outputs"][0]["data"] == [sim_digest("sim", 1, f"r{i}")]

        async def caller(k: int) -> None:  # for 1.5 s at least: more than the burst's worth
            for n in range(500):
                if time.monotonic() - t0 > 1.5:
                    return
                await call(k * 1000 + n)

        await asyncio.gather(*(caller(k) for k in range(8)))
    elapsed = time.monotonic() - t0
    assert set(statuses) <= {200, 429}
    assert statuses.count(429) > 0
    assert 1 <= statuses.count(200) <= 20 + 20.0 * elapsed + 1  # at most the burst, then the rate
    assert max(waits_ms) <= 1000.0 / 20.0 + 1  # one token's wait at most


async def test_the_admission_rate_refuses_before_the_body_is_read(capped_server: ServerProc) -> None:
    head = infer_head(capped_server.port, b"x" * 100_000, close=False)  # the body never comes
    answers = await asyncio.gather(*(raw_exchange(capped_server.port, head) for _ in range(40)))
    statuses = [status_of(a) for a in answers]
    assert set(statuses) <= {429, 408}, sorted(set(statuses))  # refused at once, or out of body time
    assert 429 in statuses


async def test_a_keep_alive_connection_carries_on_after_a_429_with_its_body_skipped(
    capped_server: ServerProc,
) -> None:
    port = capped_server.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    statuses = []
    try:
        for i in range(80):
            body = json.dumps(infer_json(f"k{i}")).encode()
            writer.write(infer_head(port, body, close=False) + body)
            status, head, answer = await read_response(reader)
            statuses.append(status)
            assert b"connection: close" not in head.lower()
            if status == 200:
                assert sim_digest("sim", 1, f"k{i}") in json.loads(answer)["outputs"][0]["data"]
            if status == 429 and statuses.count(200) > 0 and i > 40:
                break
    finally:
        writer.close()
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses


async def test_with_the_cap_held_open_the_next_connection_is_refused_and_counted(
    capped_server: ServerProc,
) -> None:
    port, held = capped_server.port, []
    refused = b""
    try:
        for _ in range(200):  # 64, plus any the server still holds from before
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            held.append(writer)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            status, head, body = await read_response(reader)
            if status == 429:
                refused = head + body
                break
            assert status == 200
    finally:
        for writer in held:
            writer.close()
    assert b"too many connections: 64 open, the limit is 64" in refused, refused
    assert len(held) <= 65
    await asyncio.gather(*(one_request(port, i) for i in range(45)))  # past the admission burst
    async with aiohttp.ClientSession() as http, http.get(f"{capped_server.url}/metrics") as r:
        text = await r.text()
    counts = dict(re.findall(r'^inferd_frontdoor_refused_total\{reason="(\w+)"\} (\S+)$', text, re.M))
    assert float(counts["rate"]) > 0 and float(counts["connections"]) > 0, counts
    assert re.search(r"^inferd_frontdoor_connections \d", text, re.M)
