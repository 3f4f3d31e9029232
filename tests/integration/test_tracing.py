"""Traces end to end: a real `inferd serve` with the sim model and its worker process export OTLP/HTTP to a
receiver this test runs, and the spans continue the caller's traceparent across both processes."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.conftest import ServerProc, start_server
from tests.integration.search_fixtures import model_repo, wait_serving

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


class Receiver:
    """An OTLP/HTTP traces endpoint: POST /v1/traces with protobuf bodies; keeps (pid, span) pairs."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, object]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ok = self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
                if ok:
                    receiver.add(ExportTraceServiceRequest.FromString(body))
                self.send_response(200 if ok else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def add(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value for a in resource_spans.resource.attributes}
            pid = attrs["process.pid"].int_value
            for scope in resource_spans.scope_spans:
                with self.lock:
                    self.spans.extend((pid, span) for span in scope.spans)

    def wait_for(
        self, trace_id: str, names: set[str], within_s: float
    ) -> dict[str, list[tuple[int, object]]]:
        deadline = time.monotonic() + within_s
        while True:
            with self.lock:
                found: dict[str, list[tuple[int, object]]] = {}
                for pid, span in self.spans:
                    if span.trace_id.hex() == trace_id:  # type: ignore[attr-defined]
                        found.setdefault(span.name, []).append((pid, span))  # type: ignore[attr-defined]
            if names <= set(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    yield r
    r.http.shutdown()
    r.http.server_close()


@pytest.fixture
def server(tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerProc]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 100 ms (the SDK's variable)
    s = start_server(
        tmp_path, "--model", "sim", "--workers", "1", "--trace-endpoint", receiver.url, "--trace-sample", "0"
    )
    yield s
    assert s.stop() in (0, -15)


def infer(server: ServerProc, headers: dict[str, str]) -> tuple[dict, dict[str, str]]:
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["traced"]}]}
    req = urllib.request.Request(
        f"{server.url}/v2/models/sim/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}


def test_spans_of_front_end_and_worker_continue_the_callers_trace(
    server: ServerProc, receiver: Receiver
) -> None:
    # --trace-sample 0: only the caller's sampled traceparent makes this request recorded
    headers = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "X-Request-Id": "trace-me.1"}
    _, got = infer(server, headers)
    assert got["x-request-id"] == "trace-me.1"
    infer(server, {})  # not sampled: nothing of it may be exported
    names = {"inferd.request", "inferd.queue", "inferd.batch", "inferd.worker.compute"}
    found = receiver.wait_for(CALLER_TRACE, names, within_s=20)
    assert names <= set(found), f"spans seen in the caller's trace: {sorted(found)}"
    front_pid, request = found["inferd.request"][0]
    queue_pid, queue = found["inferd.queue"][0]
    batch_pid, batch = found["inferd.batch"][0]
    worker_pid, compute = found["inferd.worker.compute"][0]

    assert front_pid == queue_pid == batch_pid == server.proc.pid
    assert worker_pid in server.worker_pids() and worker_pid != front_pid
    assert request.parent_span_id.hex() == CALLER_SPAN
    attrs = {a.key: a.value for a in request.attributes}
    assert attrs["route"].string_value == "/v2/models/{model}/infer"
    assert attrs["model"].string_value == "sim" and attrs["outcome"].string_value == "ok"
    assert attrs["version"].int_value == 1
    assert queue.parent_span_id == request.span_id
    assert batch.parent_span_id == request.span_id
    assert [link.span_id for link in batch.links] == [request.span_id]
    assert compute.parent_span_id == batch.span_id
    with receiver.lock:
        traces = {span.trace_id.hex() for _, span in receiver.spans}  # type: ignore[attr-defined]
    assert traces == {CALLER_TRACE}, "the unsampled request left no span"


def test_a_search_has_embed_shard_and_fuse_spans_under_its_request(
    tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    repo = model_repo(tmp_path, replicas=1)
    s = start_server(
        tmp_path, "--model-repo", str(repo), "--data-dir", str(tmp_path / "data"),
        "--trace-endpoint", receiver.url, "--trace-sample", "0",
    )  # fmt: skip
    try:
        wait_serving(s.url, "docs", [1, 1])
        req = urllib.request.Request(
            f"{s.url}/v1/indexes/docs/search",
            data=json.dumps({"query": "zebra", "mode": "hybrid"}).encode(),
            headers={
                "Content-Type": "application/json",
                "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
            },
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["coverage"] == {"shards": 2, "answered": 2}
        names = {"inferd.request", "inferd.search.embed", "inferd.search.shard", "inferd.search.fuse"}
        found = receiver.wait_for(CALLER_TRACE, names, within_s=20)
    finally:
        assert s.stop() in (0, -15)
    assert names <= set(found), f"spans seen in the caller's trace: {sorted(found)}"
    request = found["inferd.request"][0][1]
    shards = [span for _, span in found["inferd.search.shard"]]
    for span in [found["inferd.search.embed"][0][1], found["inferd.search.fuse"][0][1], *shards]:
        assert span.parent_span_id == request.span_id  # type: ignore[attr-defined]
    attrs = [{a.key: a.value for a in span.attributes} for span in shards]  # type: ignore[attr-defined]
    assert sorted(a["shard"].int_value for a in attrs) == [0, 1]
    assert all(a["outcome"].string_value == "answered" and not a["hedge"].bool_value for a in attrs)
