"""Overload, deadlines, disconnects, bad input and misbehaving models, against real processes.

The `sim` model here is slow (200 ms per batch of at most 10, queue bound 40) so queues form on purpose.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Iterator

import aiohttp
import pytest

from inferd.models.sim import sim_digest
from tests.conftest import ROOT, ServerProc, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(
        tmp_path_factory.mktemp("faulty"), "--model-repo", str(ROOT / "tests" / "data" / "faulty_repo")
    )
    yield s
    assert s.stop() in (0, -15)


def body(texts: list[str], rid: str = "x", **params: object) -> dict:
    out: dict = {
        "id": rid,
        "inputs": [{"name": "INPUT0", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
    }
    if params:
        out["parameters"] = params
    return out


async def metric(http: aiohttp.ClientSession, url: str, pattern: str) -> float:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    m = re.search(pattern + r" ([0-9.e+]+)", text)
    return float(m.group(1)) if m else 0.0


async def test_overload_gets_fast_429_with_retry_after_not_timeouts(server: ServerProc) -> None:
    url = f"{server.url}/v2/models/sim/infer"
    async with aiohttp.ClientSession() as http:

        async def call(i: int) -> tuple[int, dict, float]:
            t0 = asyncio.get_running_loop().time()
            async with http.post(url, json=body([f"o{i}"], f"o{i}")) as r:
                payload = await r.json()
                return (
                    r.status,
                    {"retry": r.headers.get("Retry-After"), **payload},
                    asyncio.get_running_loop().time() - t0,
                )

        results = await asyncio.gather(*(call(i) for i in range(120)))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    ok = [(p, i) for i, (s, p, _) in enumerate(results) if s == 200]
    rejected = [(p, t) for s, p, t in results if s == 429]
    assert len(ok) >= 40 and len(rejected) >= 30, (len(ok), len(rejected))
    for p, i in ok:
        assert p["outputs"][0]["data"] == [sim_digest("sim", 1, f"o{i}")]
    for p, elapsed in rejected:
        assert int(p["retry"]) >= 1
        assert "queue is full" in p["error"] or "cannot meet the deadline" in p["error"]
        assert elapsed < 1.0, "a rejection must be fast, not a timeout"


async def test_request_that_cannot_meet_its_deadline_is_refused_at_admission(server: ServerProc) -> None:
    url = f"{server.url}/v2/models/sim/infer"
    async with aiohttp.ClientSession() as http:
        fill = [asyncio.ensure_future(http.post(url, json=body([f"f{i}"]))) for i in range(30)]
        await asyncio.sleep(0)  # let the fill requests go out first; the refusal is checked below
        async with http.post(url, json=body(["late"]), headers={"X-Request-Timeout-Ms": "150"}) as r:
            status, payload = r.status, await r.json()
        for f in fill:
            (await f).release()
    if status == 429:
        assert "predicted wait" in payload["error"] and "deadline" in payload["error"]
    else:  # admitted before the estimator had data: then it must expire, not run late
        assert status == 504, payload


async def test_item_expiring_in_queue_gets_504(server: ServerProc) -> None:
    url = f"{server.url}/v2/models/sim/infer"
    async with aiohttp.ClientSession() as http:
        fill = [asyncio.ensure_future(http.post(url, json=body([f"g{i}"]))) for i in range(20)]
        await asyncio.sleep(0.05)
        # OIP timeout parameter in microseconds: 450 ms, admitted (predicted ~400-600 ms) or refused fast
        async with http.post(url, json=body(["exp"], timeout=450_000)) as r:
            status, payload = r.status, await r.json()
        for f in fill:
            (await f).release()
    assert status in (200, 429, 504), payload
    if status == 504:
        assert "deadline" in payload["error"]


async def test_client_disconnect_withdraws_queued_request(server: ServerProc) -> None:
    url = f"{server.url}/v2/models/sim/infer"
    async with aiohttp.ClientSession() as http:
        before = await metric(
            http, server.url, r'inferd_requests_total\{model="sim",outcome="cancelled",protocol="http",version="1"\}'
        )
        # three full batches of 10 items: one runs (200 ms), one is staged, one waits in the queue
        fill = [
            asyncio.ensure_future(http.post(url, json=body([f"d{i}.{j}" for j in range(10)])))
            for i in range(3)
        ]
        async with aiohttp.ClientSession() as other:
            leaving = asyncio.ensure_future(other.post(url, json=body(["gone"])))
            # leave only once the server holds it: its item is counted in the queue, alone (1) or behind
            # the third batch (11); a depth of 10 or 0 is the third batch without it. No fixed sleep:
            # on a loaded machine the request may take longer than any window to arrive.
            for _ in range(500):
                depth = await metric(http, server.url, r'inferd_queue_depth\{model="sim",version="1"\}')
                if depth in (1.0, 11.0):
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("the request never showed in the queue")
            leaving.cancel()
        for f in fill:
            (await f).release()
        after = await metric(
            http, server.url, r'inferd_requests_total\{model="sim",outcome="cancelled",protocol="http",version="1"\}'
        )
        depth = await metric(http, server.url, r'inferd_queue_depth\{model="sim",version="1"\}')
    assert after == before + 1
    assert depth == 0


async def test_wrong_number_of_outputs_fails_the_batch_clearly(server: ServerProc) -> None:
    url = f"{server.url}/v2/models/wrong_count/infer"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body(["a", "b", "c"])) as r:
            assert r.status == 422
            assert "returned 2 outputs for a batch of 3 inputs" in (await r.json())["error"]
        async with http.post(url, json=body(["solo"])) as r:  # the server keeps serving
            assert r.status == 200
            assert (await r.json())["outputs"][0]["data"] == ["ok:solo"]


async def test_model_exception_fails_its_batch_and_server_keeps_serving(server: ServerProc) -> None:
    url = f"{server.url}/v2/models/sim/infer"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body(["!fail now"])) as r:
            assert r.status == 422
            assert "simulated failure" in (await r.json())["error"]
        async with http.post(url, json=body(["fine"])) as r:
            assert r.status == 200


BAD_INPUTS = [
    ("malformed json", b'{"inputs": [', {}, 400, "malformed JSON"),
    ("trailing garbage", b'{"inputs": []} xyz', {}, 400, "malformed JSON"),
    ("empty body", b"", {}, 400, "empty request body"),
    ("wrong content type", b'{"inputs": []}', {"Content-Type": "text/plain"}, 415, "Content-Type"),
    ("no inputs field", b'{"id": "1"}', {}, 400, "inputs"),
    (
        "shape/data mismatch",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3]}]}',
        {},
        400,
        "shape holds 4 elements but data has 3",
    ),
    (
        "unknown datatype",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP8","data":[1,2,3,4]}]}',
        {},
        400,
        "unknown datatype 'FP8'",
    ),
    (
        "wrong datatype",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"INT32","data":[1,2,3,4]}]}',
        {},
        400,
        "must be FP32",
    ),
    (
        "string in FP32",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,"a",3,4]}]}',
        {},
        400,
        "is not a number",
    ),
    (
        "overflow to inf",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,1e300,3,4]}]}',
        {},
        400,
        "finite",
    ),
    (
        "wrong per-item shape",
        b'{"inputs":[{"name":"INPUT0","shape":[1,3],"datatype":"FP32","data":[1,2,3]}]}',
        {},
        400,
        "per-item shape must be [4]",
    ),
    (
        "negative dim",
        b'{"inputs":[{"name":"INPUT0","shape":[-1,4],"datatype":"FP32","data":[1,2,3,4]}]}',
        {},
        400,
        "negative dimension",
    ),
    (
        "huge dims",
        b'{"inputs":[{"name":"INPUT0","shape":[60,4294967296],"datatype":"FP32","data":[1]}]}',
        {},
        400,
        "per-item shape must be [4]",
    ),
    (
        "too many items",
        b'{"inputs":[{"name":"INPUT0","shape":[65,4],"datatype":"FP32","data":[1]}]}',
        {},
        400,
        "at most 64 per request",
    ),
    (
        "too many inputs",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]},'
        b'{"name":"X","shape":[1],"datatype":"FP32","data":[1]}]}',
        {},
        400,
        "takes 1",
    ),
    (
        "unknown input",
        b'{"inputs":[{"name":"NOPE","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}',
        {},
        400,
        "unknown input 'NOPE'",
    ),
    (
        "unknown output",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}],'
        b'"outputs":[{"name":"NOPE"}]}',
        {},
        400,
        "unknown output 'NOPE'",
    ),
    (
        "deep nesting",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":'
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}]}",
        {},
        400,
        "nested too deeply",
    ),
    (
        "bad timeout header",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}',
        {"X-Request-Timeout-Ms": "soon"},
        400,
        "X-Request-Timeout-Ms",
    ),
    (
        "negative timeout",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}],'
        b'"parameters":{"timeout":-5}}',
        {},
        400,
        "timeout",
    ),
    (
        "binary size without header",
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32",'
        b'"parameters":{"binary_data_size":16}}]}',
        {},
        400,
        "Inference-Header-Content-Length",
    ),
]


@pytest.mark.parametrize(
    ("case", "payload", "headers", "status", "message"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS]
)
async def test_bad_input_gets_clear_4xx(server: ServerProc, case, payload, headers, status, message) -> None:
    hdrs = {"Content-Type": "application/json", **headers}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/v2/models/scale/infer", data=payload, headers=hdrs) as r:
            assert r.status == status, await r.text()
            assert message in (await r.json())["error"]
        good = b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
        async with http.post(
            f"{server.url}/v2/models/scale/infer", data=good, headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 200


async def test_unknown_model_and_version_are_404(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/v2/models/nope/infer", json=body(["a"])) as r:
            assert r.status == 404 and "unknown model 'nope'" in (await r.json())["error"]
        async with http.post(f"{server.url}/v2/models/sim/versions/9/infer", json=body(["a"])) as r:
            assert r.status == 404 and "version '9'" in (await r.json())["error"]


def recv_response(s: socket.socket, first: bytes = b"") -> bytes:
    """Read one HTTP response (headers plus Content-Length body) from a raw socket."""
    data = first
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(rest) < length:
        chunk = s.recv(4096)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


def test_body_over_limit_is_refused_without_reading_it(server: ServerProc) -> None:
    """Announce 100 MiB, send a few bytes: the 413 arrives without the server waiting for the rest."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(
            b"POST /v2/models/sim/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 104857600\r\n\r\n{"inputs":'
        )
        reply = recv_response(s).decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "exceeds the limit" in reply


def test_chunked_body_over_limit_is_refused(server: ServerProc) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(
            b"POST /v2/models/sim/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 65536
        reply = b""
        s.settimeout(0.2)
        for _ in range(200):  # up to 12.5 MiB, more than the 8 MiB limit
            try:
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                reply = s.recv(4096)
                if reply:
                    break
            except TimeoutError:
                continue
        s.settimeout(5)
        reply = recv_response(s, reply)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"exceeds the limit" in reply


async def test_interactive_requests_overtake_queued_bulk_work(server: ServerProc) -> None:
    """30 bulk requests queue on a 200 ms device (batches of 10); interactive ones sent after them
    still run in the next batch, not behind the bulk backlog."""
    url = f"{server.url}/v2/models/sim/infer"
    async with aiohttp.ClientSession() as http:

        async def call(text: str, priority: str, header: bool) -> dict:
            kwargs: dict = {"json": body([text], text, priority=priority)}
            if header:
                kwargs = {"json": body([text], text), "headers": {"X-Priority": priority}}
            async with http.post(url, **kwargs) as r:
                assert r.status == 200, await r.text()
                return {"batch": int(r.headers["X-Inferd-Batch-Id"]), "text": text}

        bulk = [asyncio.ensure_future(call(f"bulk{i}", "bulk", i % 2 == 0)) for i in range(30)]
        for _ in range(100):  # wait until the bulk work is queued
            if await metric(http, server.url, r'inferd_queue_depth\{model="sim",version="1"\}') >= 10:
                break
            await asyncio.sleep(0.01)
        inter = await asyncio.gather(*(call(f"inter{i}", "interactive", i == 0) for i in range(5)))
        bulk_done = await asyncio.gather(*bulk)
        async with http.post(url, json=body(["x"]), headers={"X-Priority": "urgent"}) as r:
            assert r.status == 400 and "priority" in (await r.json())["error"]
    last_bulk = max(b["batch"] for b in bulk_done)
    assert all(i["batch"] < last_bulk for i in inter), (inter, last_bulk)
