"""Zone routing with real processes on loopback: `inferd serve --zone a` with its own worker (started in
zone a) and a remote `inferd worker --zone b`. While zone a is healthy every request is served there; when
its worker is killed, zone b serves at once, and every answer is its caller's. What went where is read
from the front end's /metrics, as the locality benchmark reads it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from inferd.models.sim import sim_digest
from tests.conftest import ROOT, free_port, start_server
from tests.integration.test_remote_worker import infer

TOKEN = "join-secret-for-zone-tests"


def served_by_zone(url: str) -> dict[tuple[str, str], float]:
    """inferd_requests_by_zone_total of model sim, by (zone, local)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'inferd_requests_by_zone_total\{(.*)\} (\S+)$', line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels["model"] == "sim":
            out[(labels["zone"], labels["local"])] = float(m.group(2))
    return out


def workers_by_zone(admin_url: str) -> dict[str, str | None]:
    with urllib.request.urlopen(f"{admin_url}/admin/workers", timeout=5) as r:
        rows = json.loads(r.read())["workers"]
    return {w["worker_id"]: w["zone"] for w in rows if w["model"] == "sim" and w["state"] == "ready"}


def wait_until(what: str, check, within_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {within_s} s: {what}")


@pytest.fixture
def join_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_JOIN_TOKEN", TOKEN)


def test_requests_stay_in_the_front_ends_zone_while_it_is_healthy(tmp_path: Path, join_token: None) -> None:
    worker_port = free_port()
    server = start_server(
        tmp_path, "--model", "sim", "--workers", "1", "--zone", "a", "--worker-port", str(worker_port)
    )
    log = open(tmp_path / "worker-b.log", "wb")
    remote = subprocess.Popen(
        [sys.executable, "-m", "inferd.cli.main", "worker", "--connect", f"127.0.0.1:{worker_port}",
         "--model", "sim", "--worker-id", "remote-b", "--zone", "b"],
        env={**os.environ, "INFERD_JOIN_TOKEN": TOKEN}, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    try:
        wait_until("a worker of each zone ready", lambda: sorted(
            z for z in workers_by_zone(server.admin_url).values() if z) == ["a", "b"], 30)
        zones = workers_by_zone(server.admin_url)
        assert zones["remote-b"] == "b" and list(zones.values()).count("a") == 1  # the local one: zone a
        for i in range(60):
            assert infer(server.url, f"in-zone-{i}") == sim_digest("sim", 1, f"in-zone-{i}")
        assert served_by_zone(server.url) == {("a", "true"): 60.0, ("b", "false"): 0.0}

        (local_pid,) = server.worker_pids()
        (local_id,) = (w for w, z in zones.items() if z == "a")
        os.kill(local_pid, signal.SIGKILL)  # zone a loses its only worker: zone b serves at once
        wait_until("the lost worker gone", lambda: local_id not in workers_by_zone(server.admin_url), 10)
        for i in range(20):
            assert infer(server.url, f"spilled-{i}") == sim_digest("sim", 1, f"spilled-{i}")
        after = served_by_zone(server.url)
        assert after[("a", "true")] + after[("b", "false")] == 80.0
        assert after[("b", "false")] >= 1.0, after  # its replacement's zone gets work back only after the hold
    finally:
        remote.send_signal(signal.SIGTERM)
        remote.wait(10)
        server.stop()
