"""`inferd worker --connect dns:NAME:PORT`: the worker joins every front end NAME resolves to and follows
the name (real processes on loopback; the name resolves through a hosts-format file the test rewrites,
`--hosts-file`, so no root is needed: the network-namespace version comes with the multi-host tests).

Two front ends listen for workers on the same port at 127.0.0.2 and 127.0.0.3, as pods behind a
headless Service do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.checked_load import Load, infer, tally, wait_answers, wait_for
from tests.conftest import ROOT, ServerProc, free_port, start_server

TOKEN = "join-secret-for-dns-tests"
NAME = "frontends.inferd.test"
MODEL = """builtin = "sim"
workers = 0
max_batch_size = 4
max_wait_ms = 5
default_timeout_ms = 3000

[params]
base_ms = 60.0
per_item_ms = 0.0
"""
"""Batches long enough that some are on the worker when it leaves a front end; requests left queued on a
front end without workers end in 3 s."""


@pytest.fixture
def router_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_JOIN_TOKEN", TOKEN)


def admin_workers(server: ServerProc) -> dict:
    with urllib.request.urlopen(f"{server.admin_url}/admin/workers", timeout=5) as r:
        return json.loads(r.read())


def joined(server: ServerProc) -> list[str]:
    return [w["worker_id"] for w in admin_workers(server)["workers"]]


def metric_total(server: ServerProc, name: str) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def front_end(tmp_path: Path, repo: Path, host: str, worker_port: int, name: str) -> ServerProc:
    return start_server(
        tmp_path,
        *("--model-repo", str(repo), "--model", "sim", "--data-dir", str(tmp_path / f"data-{name}")),
        *("--worker-host", host, "--worker-port", str(worker_port), "--frontend-id", name, "--zone", "zone-a"),
        ready_path="/v2/health/live",
    )


def test_a_worker_follows_a_dns_name_joining_front_ends_added_and_leaving_those_gone(
    tmp_path: Path, router_env: None
) -> None:
    repo = tmp_path / "repo"
    (repo / "sim" / "1").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text(MODEL)
    hosts = tmp_path / "hosts"
    hosts.write_text("# nothing yet\n")
    port = free_port()
    log_path = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [
            *(sys.executable, "-m", "inferd.cli.main", "worker", "--connect", f"dns:{NAME}:{port}"),
            *("--model", "sim", "--worker-id", "dns-1", "--zone", "zone-b", "--insecure"),
            *("--hosts-file", str(hosts), "--resolve-every-s", "0.2"),
        ],
        env={**os.environ, "INFERD_JOIN_TOKEN": TOKEN},
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    servers: list[ServerProc] = []
    try:
        # the name does not resolve at start: retried and said, the worker waits
        wait_for(lambda: "does not resolve" in log_path.read_text(), 30, "the worker saying so")
        assert worker.poll() is None

        a = front_end(tmp_path, repo, "127.0.0.2", port, "fe-a")
        servers.append(a)
        hosts.write_text(f"127.0.0.2 {NAME}\n")
        wait_for(lambda: joined(a) == ["dns-1"], 30, "the worker on front end a")
        page = admin_workers(a)
        assert page["frontend"] == {"id": "fe-a", "zone": "zone-a"}
        assert page["workers"][0]["zone"] == "zone-b"
        assert "resolves again" in log_path.read_text()

        # a front end added to the name later is joined too
        b = front_end(tmp_path, repo, "127.0.0.3", port, "fe-b")
        servers.append(b)
        assert joined(b) == []
        hosts.write_text(f"127.0.0.2 {NAME}\n127.0.0.3 {NAME}\n")
        wait_for(lambda: joined(b) == ["dns-1"], 30, "the worker on front end b")
        for server in (a, b):
            answer = infer(server.url, f"on-{server.port}")
            assert answer is not None and answer.correct, answer

        # a front end gone from the name is left under load: the worker drains from it alone
        with Load(a.url, "leave", clients=4, max_requests=400, max_s=30) as load:
            wait_answers(load, 20)
            hosts.write_text(f"127.0.0.3 {NAME}\n")
            wait_for(lambda: joined(a) == [], 30, "the worker leaving front end a")
        t = tally(load)
        assert t.lost == 0 and not load.unanswered and t.duplicated == 0 and t.misrouted == 0
        assert t.ok >= 20
        assert metric_total(a, "inferd_batch_failures_total") == 0, "no batch it sent was dropped"
        assert metric_total(a, "inferd_retried_items_total") == 0
        assert joined(b) == ["dns-1"] and worker.poll() is None
        answer = infer(b.url, "after-leaving-a")
        assert answer is not None and answer.correct, answer
        left = [line for line in a.log().splitlines() if "dns-1" in line]
        assert any("drained and left" in line for line in left), left
        assert not any(" lost" in line for line in left), left
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(15)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        for server in servers:
            server.stop()
    assert worker.returncode == 0, log_path.read_text()[-3000:]
    assert "leaving the front end at 127.0.0.2" in log_path.read_text()
