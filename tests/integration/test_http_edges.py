"""HTTP edges against real `inferd serve` processes: over-limit bodies read by clients that send the whole
body before reading (urllib), and the SIGTERM grace period (ready 503 while still serving)."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from inferd.models.sim import sim_digest
from tests.conftest import ROOT, ServerProc, start_server

LIMIT = 1024 * 1024


@pytest.fixture(scope="module")
def small_body_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("edges")
    config = tmp / "server.toml"
    config.write_text(f"[server]\nmax_body_bytes = {LIMIT}\n")
    s = start_server(tmp, "--model", "sim", "--config", str(config))
    yield s
    assert s.stop() == 0


def post(url: str, data: object, timeout_s: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    """POST with urllib, which sends the whole body before it reads the answer."""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})  # type: ignore[arg-type]
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def infer_body(texts: list[str]) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}
    ).encode()


def test_urllib_reads_the_413_of_a_content_length_body_over_the_limit(
    small_body_server: ServerProc,
) -> None:
    status, headers, body = post(f"{small_body_server.url}/v2/models/sim/infer", b"x" * (3 * LIMIT))
    assert status == 413
    assert headers["connection"] == "close"
    assert f"{3 * LIMIT} bytes exceeds the limit of {LIMIT} bytes" in json.loads(body)["error"]


def test_urllib_reads_the_413_of_a_chunked_body_over_the_limit(small_body_server: ServerProc) -> None:
    chunks = (b"x" * 65536 for _ in range(3 * LIMIT // 65536))  # an iterable: urllib sends it chunked
    status, headers, body = post(f"{small_body_server.url}/v1/embeddings", chunks)
    assert status == 413
    assert headers["connection"] == "close"
    assert f"exceeds the limit of {LIMIT} bytes" in json.loads(body)["error"]["message"]


def test_the_connection_after_a_413_is_not_needed_to_serve_the_next_request(
    small_body_server: ServerProc,
) -> None:
    url = f"{small_body_server.url}/v2/models/sim/infer"
    assert post(url, b"x" * (LIMIT + 1))[0] == 413
    status, _, body = post(url, infer_body(["after"]))
    assert status == 200
    assert json.loads(body)["outputs"][0]["data"] == [sim_digest("sim", 1, "after")]


def ready_status(server: ServerProc) -> int:
    try:
        with urllib.request.urlopen(f"{server.url}/v2/health/ready", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def batches_in_flight(server: ServerProc) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return float(text.split('inferd_inflight_batches{model="sim",version="1"} ')[1].split()[0])


def test_sigterm_turns_ready_503_while_requests_are_still_served_then_exits_0(tmp_path: Path) -> None:
    """The `sim` here takes 200 ms per batch, so requests sent before SIGTERM are still in flight."""
    grace_s = 4.0
    server = start_server(
        tmp_path,
        *("--model-repo", str(ROOT / "tests" / "data" / "faulty_repo"), "--model", "sim"),
        *("--shutdown-grace-s", str(grace_s)),
    )
    url = f"{server.url}/v2/models/sim/infer"
    try:
        with ThreadPoolExecutor(max_workers=6) as pool:
            before = [pool.submit(post, url, infer_body([f"before-{i}"])) for i in range(6)]
            for _ in range(200):  # until a batch runs (bounded: the requests are answered regardless)
                if batches_in_flight(server) >= 1:
                    break
            signalled_at = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            for _ in range(100):  # the signal is handled within milliseconds; allow about a second
                if ready_status(server) == 503:
                    break
                time.sleep(0.01)
            assert ready_status(server) == 503
            during = post(url, infer_body(["during"]))  # a new connection: the listener still accepts
            assert server.proc.poll() is None
            answers = [f.result(timeout=30) for f in before]
        assert during[0] == 200
        assert json.loads(during[2])["outputs"][0]["data"] == [sim_digest("sim", 1, "during")]
        assert [a[0] for a in answers] == [200] * 6
        for i, (_, _, body) in enumerate(answers):
            assert json.loads(body)["outputs"][0]["data"] == [sim_digest("sim", 1, f"before-{i}")]
        assert server.proc.wait(timeout=30 + grace_s) == 0, server.log()
        assert time.monotonic() - signalled_at >= grace_s  # it kept serving through the whole grace
        assert "SIGTERM: not ready; serving 4.0 s more, then draining" in server.log()
    finally:
        server.stop()  # a second SIGTERM ends the grace at once if a check failed; no worker outlives it
