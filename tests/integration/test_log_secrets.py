"""Structured logs of a real server and a remote worker at DEBUG, with a tenant key and a join token: every
request line names its request, tenant and model, and no key, token or Authorization value appears in
any line either process writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.gateway.keys import key_digest, new_key
from tests.conftest import ROOT, ServerProc, free_port, start_server

KEY = new_key()
WRONG = new_key()
JOIN = "join-token-that-must-stay-secret"


def call(server: ServerProc, headers: dict[str, str], path: str = "/v2/models/sim/infer") -> tuple[int, dict]:
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    req = urllib.request.Request(
        server.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()} | {"body": r.read().decode()}
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()} | {"body": exc.read().decode()}


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ServerProc, Path]]:
    monkeypatch.setenv("INFERD_JOIN_TOKEN", JOIN)
    config = tmp_path / "inferd.toml"
    config.write_text(f'[tenants.alpha]\nmodels = ["sim"]\napi_key_sha256 = ["{key_digest(KEY)}"]\n')
    worker_port = free_port()
    server = start_server(
        tmp_path,
        *("--model", "sim", "--workers", "0", "--worker-port", str(worker_port), "--config", str(config)),
        *("--log-level", "DEBUG", "--log-format", "json", "--access-log-sample", "1"),
        ready_path="/v2/health/live",
    )
    worker_log = tmp_path / "worker.log"
    with open(worker_log, "wb") as out:
        worker = subprocess.Popen(
            [
                *(sys.executable, "-m", "inferd.cli.main", "worker"),
                *("--connect", f"127.0.0.1:{worker_port}", "--model", "sim"),
                *("--log-level", "DEBUG", "--log-format", "json"),
            ],
            env={**os.environ, "INFERD_JOIN_TOKEN": JOIN},
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 30
        while call(server, {"Authorization": f"Bearer {KEY}"})[0] != 200:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        yield server, worker_log
    finally:
        worker.terminate()
        worker.wait(10)
        server.stop()


def test_logs_name_the_request_and_never_hold_keys_tokens_or_authorization(
    fleet: tuple[ServerProc, Path],
) -> None:
    server, worker_log = fleet
    status, got = call(server, {"Authorization": f"Bearer {KEY}", "X-Request-Id": "req-ok.1"})
    assert status == 200 and got["x-request-id"] == "req-ok.1"
    status, got = call(server, {"X-API-Key": KEY, "X-Request-Id": "bad id with spaces"})
    assert status == 200 and got["x-request-id"] != "bad id with spaces"
    status, got = call(server, {"Authorization": f"Bearer {WRONG}", "X-Request-Id": "req-401"})
    assert status == 401 and json.loads(got["body"])["request_id"] == "req-401"
    status, got = call(
        server, {"Authorization": f"Bearer {KEY}", "X-Request-Id": "x" * 129}, "/v1/embeddings"
    )
    assert status == 400 and json.loads(got["body"])["error"]["request_id"] == got["x-request-id"]
    assert len(got["x-request-id"]) <= 128 and got["x-request-id"] != "x" * 129
    server.stop()  # flushes every line

    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    access = [line for line in lines if line["logger"] == "inferd.access"]
    ok = next(line for line in access if line.get("request_id") == "req-ok.1")
    assert ok["tenant"] == "alpha" and ok["model"] == "sim" and ok["status"] == 200
    assert ok["outcome"] == "ok" and ok["attempts"] == "1" and ok["batch_id"] != "-"
    assert next(line for line in access if line.get("request_id") == "req-401")["status"] == 401
    everything = server.log() + worker_log.read_text()
    worker_lines = [json.loads(line) for line in worker_log.read_text().splitlines() if line.startswith("{")]
    assert any(line["logger"] == "inferd.worker" for line in worker_lines), "the worker logs JSON too"
    for secret in (KEY, WRONG, JOIN):
        assert secret not in everything
    assert "authorization" not in everything.lower()
