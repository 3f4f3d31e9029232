"""Workers on other hosts: `inferd worker --connect HOST:PORT` joins a router over TCP, with a join token,
and registers again when the router restarts (router and worker are separate processes on loopback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from inferd.models.sim import sim_digest
from tests.checked_load import Load, assert_exactly_once, tally, wait_answers, wait_for
from tests.conftest import ROOT, ServerProc, free_port, start_server

TOKEN = "join-secret-for-tests"


def infer(url: str, text: str) -> str:
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    ).encode()
    req = urllib.request.Request(
        f"{url}/v2/models/sim/infer", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["outputs"][0]["data"][0]


def wait_ready(url: str, within_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        try:
            with urllib.request.urlopen(f"{url}/v2/models/sim/ready", timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url} not ready within {within_s}s")


def start_worker(
    tmp_path: Path, port: int, token: str, worker_id: str = "remote-1"
) -> subprocess.Popen[bytes]:
    log = open(tmp_path / f"worker-{worker_id}-{time.monotonic_ns()}.log", "wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferd.cli.main",
            "worker",
            "--connect",
            f"127.0.0.1:{port}",
            "--model",
            "sim",
            "--worker-id",
            worker_id,
        ],
        env={**os.environ, "INFERD_JOIN_TOKEN": token},
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


@pytest.fixture
def router_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_JOIN_TOKEN", TOKEN)


def test_remote_worker_joins_and_survives_a_router_restart(tmp_path: Path, router_env: None) -> None:
    worker_port = free_port()
    args = ("--model", "sim", "--workers", "0", "--worker-port", str(worker_port))
    router = start_server(tmp_path, *args, ready_path="/v2/health/live")
    worker = start_worker(tmp_path, worker_port, TOKEN)
    try:
        wait_ready(router.url, 30)
        assert infer(router.url, "before") == sim_digest("sim", 1, "before")
        assert router.worker_pids() == [], "no local worker: the model is served by the remote one"
        router.proc.send_signal(signal.SIGKILL)
        router.proc.wait(10)
        assert worker.poll() is None, "the remote worker outlives its router"
        router2 = start_server(tmp_path, *args, "--port", str(router.port), ready_path="/v2/health/live")
        try:
            rejoined_s = wait_ready(router2.url, 10)
            assert rejoined_s <= 5.0, f"fleet view rebuilt in {rejoined_s:.1f}s"
            assert infer(router2.url, "after") == sim_digest("sim", 1, "after")
        finally:
            router2.stop()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(10)


def test_worker_with_a_bad_token_is_refused(tmp_path: Path, router_env: None) -> None:
    worker_port = free_port()
    router = start_server(
        tmp_path,
        "--model",
        "sim",
        "--workers",
        "0",
        "--worker-port",
        str(worker_port),
        ready_path="/v2/health/live",
    )
    worker = start_worker(tmp_path, worker_port, "wrong-token")
    try:
        assert worker.wait(15) == 2
        with urllib.request.urlopen(f"{router.url}/v2/health/ready", timeout=2) as r:
            pytest.fail(f"router must not be ready without a worker, got {r.status}")
    except urllib.error.HTTPError as exc:
        assert exc.code == 503
    finally:
        if worker.poll() is None:
            worker.kill()
        router.stop()
    assert "bad join token" in router.log()


def test_worker_port_without_join_token_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("INFERD_JOIN_TOKEN", raising=False)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferd.cli.main",
            "serve",
            "--model",
            "sim",
            "--worker-port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "INFERD_JOIN_TOKEN" in out.stderr


SLOW_SIM = """builtin = "sim"
workers = 0
max_batch_size = 4
max_wait_ms = 5

[params]
base_ms = 150.0
per_item_ms = 0.0
"""
"""Batches long enough that a worker signalled under load holds some."""


def connected_workers(router: ServerProc) -> dict[str, int]:
    """Worker id -> the batches it holds."""
    with urllib.request.urlopen(f"{router.admin_url}/admin/workers", timeout=5) as r:
        return {w["worker_id"]: w["inflight_batches"] for w in json.loads(r.read())["workers"]}


def metric_total(router: ServerProc, name: str) -> float:
    with urllib.request.urlopen(f"{router.url}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def test_a_remote_worker_stopped_by_sigterm_drains_its_batches_and_exits_0(
    tmp_path: Path, router_env: None
) -> None:
    """SIGTERM mid-load: the worker tells the router, which sends it no more batches; it delivers the
    ones it holds and exits 0. Every request is answered once, correctly, and nothing is retried."""
    repo = tmp_path / "repo"
    (repo / "sim" / "1").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text(SLOW_SIM)
    worker_port = free_port()
    args = ("--model-repo", str(repo), "--model", "sim", "--worker-port", str(worker_port))
    router = start_server(tmp_path, *args, ready_path="/v2/health/live")
    stays = start_worker(tmp_path, worker_port, TOKEN, "remote-stays")
    leaves = start_worker(tmp_path, worker_port, TOKEN, "remote-leaves")
    try:
        wait_for(lambda: len(connected_workers(router)) == 2, 30, "both workers joined")
        with Load(router.url, "sigterm", clients=8, max_requests=250, max_s=20) as load:
            wait_answers(load, 30)
            wait_for(lambda: connected_workers(router)["remote-leaves"] > 0, 10, "batches on the worker")
            leaves.send_signal(signal.SIGTERM)
            assert leaves.wait(10) == 0, "a worker stopped by SIGTERM drains and exits 0"
            assert load.answered() < load.max_requests, "the load outlasted the drain"
            load.finish(30)
        t = tally(load)
        assert_exactly_once(t, load)
        assert t.refused == 0
        assert list(connected_workers(router)) == ["remote-stays"]
        assert metric_total(router, "inferd_retried_items_total") == 0
        assert metric_total(router, "inferd_batch_failures_total") == 0
    finally:
        for worker in (leaves, stays):
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
                worker.wait(15)
        router.stop()
    left = [line for line in router.log().splitlines() if "remote-leaves" in line]
    assert any("drained and left" in line for line in left), left
    assert not any(" lost" in line for line in left), left


def admin_json(server: ServerProc, path: str, post: bool = False) -> dict:
    req = urllib.request.Request(f"{server.admin_url}{path}", data=b"" if post else None, method="POST" if post else "GET")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_a_remote_worker_of_the_default_version_follows_a_rolling_update(tmp_path: Path, router_env: None) -> None:
    """`inferd worker --model sim` (no --model-version) serves the default version: once an update
    retires it, the worker is told so (Drain, retired), drains and joins again at the new default."""
    repo = tmp_path / "repo"
    (repo / "sim" / "1").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text('builtin = "sim"\nworkers = 0\n\n[params]\nbase_ms = 2.0\n')
    worker_port = free_port()
    router = start_server(tmp_path, "--model-repo", str(repo), "--worker-port", str(worker_port), ready_path="/v2/health/live")
    worker = start_worker(tmp_path, worker_port, TOKEN)
    try:
        wait_ready(router.url, 30)
        assert infer(router.url, "before") == sim_digest("sim", 1, "before")
        (repo / "sim" / "2").mkdir()
        assert admin_json(router, "/admin/models/sim/update?version=2", post=True)["to"] == 2

        def remote_at_2() -> bool:
            rows = admin_json(router, "/admin/models")["models"]["sim"]["fleet"]
            return {"worker_id": "remote-1", "zone": None, "version": 2, "state": "ready"} in rows
        wait_for(remote_at_2, 30, "the remote worker joined again at version 2")
        assert worker.poll() is None, "it joined again: it did not exit"
        assert infer(router.url, "after") == sim_digest("sim", 2, "after")
        (log,) = tmp_path.glob("worker-remote-1-*.log")
        assert "joining again at the default version" in log.read_text()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(10)
        router.stop()
