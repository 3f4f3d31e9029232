"""`inferd serve --frontends 2`: SIGKILL of the owner (front end 0, which runs the local workers).

Its workers outlive it, go on serving front end 1, and the owner the parent starts again adopts them:
* requests on connections to front end 1 go on: no error and no wrong answer while the owner is dead
  and while it comes back (a refusal as saturated, 429 with Retry-After, is retried after it: the
  owner's restart takes CPU on a small box);
* once the owner is back, the same worker processes serve (none started twice, none lost), the one of
  a slot added at runtime (as the autoscaler adds them) included;
* an adopted worker that dies is started again by the new owner, and the parent reaps it;
* after shutdown no worker process is left.

Bounded: one server, loads capped in count and time."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from inferd.models.sim import sim_digest
from tests import frontends_harness as harness
from tests.checked_load import wait_for
from tests.conftest import ServerProc, alive, child_pids, start_server
from tests.frontends_harness import two_frontends

CONFIG = """
[models.sim]
max_batch_size = 4
max_wait_ms = 2.0

[models.sim.params]
base_ms = 5.0
per_item_ms = 0.5
"""
CLIENTS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    with two_frontends(tmp_path_factory.mktemp("frontends-owner"), CONFIG) as proc:
        yield proc


def ready_workers(server: ServerProc) -> list[dict]:
    try:
        return harness.ready_workers(server)
    except OSError:
        return []  # the owner (which serves the admin API) is not there


def worker_processes(server: ServerProc) -> set[int]:
    """The server's worker processes: its descendants that run inferd.worker.main."""
    found, todo = set(), [server.proc.pid]
    while todo:
        for pid in child_pids(todo.pop()):
            todo.append(pid)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"inferd.worker.main" in f.read() and alive(pid):
                        found.add(pid)
            except OSError:
                pass
    return found


def infer(conn: http.client.HTTPConnection, text: str) -> tuple[int, str]:
    """(status, OUTPUT0 or the error) of one request on a kept connection."""
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    conn.request("POST", "/v2/models/sim/infer", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    answer = json.loads(r.read())
    if r.status != 200:
        return r.status, answer["error"]
    return 200, answer["outputs"][0]["data"][0]


def served_by(server: ServerProc, conn: http.client.HTTPConnection, n: int) -> int:
    """Which front end a kept connection reached: the one whose count grew by one request."""

    def counts() -> dict[int, float]:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        out = {0: 0.0, 1: 0.0}
        for line in lines:
            if line.startswith("inferd_requests_total{") and 'model="sim"' in line:
                for i in out:
                    if f'frontend="{i}"' in line:
                        out[i] += float(line.rpartition(" ")[2])
        return out

    before = counts()
    for _ in range(5):  # a refusal as saturated (a scrape merges both texts on one front end): again
        answer = infer(conn, f"probe-{n}")
        if answer[0] != 429 or "saturated" not in answer[1]:
            break
        time.sleep(1.0)  # its Retry-After
    assert answer == (200, sim_digest("sim", 1, f"probe-{n}"))
    after = counts()
    (grew,) = [i for i in (0, 1) if after[i] > before[i]]
    return grew


def connections_to_front_end_1(server: ServerProc, count: int) -> list[http.client.HTTPConnection]:
    kept: list[http.client.HTTPConnection] = []
    for n in range(60):  # the kernel spreads new connections over the two listeners
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        if served_by(server, conn, n) == 1:
            kept.append(conn)
            if len(kept) == count:
                return kept
        else:
            conn.close()
    raise AssertionError(f"only {len(kept)} of {count} connections reached front end 1 in 60 tries")


@dataclass
class Clients:
    """Closed-loop clients on kept connections; every answer checked. Bounded in count and time."""

    conns: list[http.client.HTTPConnection]
    max_each: int = 3000
    max_s: float = 90.0
    ok: int = 0
    refused: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Clients:
        until = time.monotonic() + self.max_s
        self.threads = [
            threading.Thread(target=self._client, args=(i, c, until), daemon=True)
            for i, c in enumerate(self.conns)
        ]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(40)

    def answered(self) -> int:
        with self.lock:
            return self.ok

    def _client(self, index: int, conn: http.client.HTTPConnection, until: float) -> None:
        for n in range(self.max_each):
            if self.stop.is_set() or time.monotonic() > until:
                return
            text = f"owner-{index}-{n}"
            try:
                status, out = infer(conn, text)
            except (OSError, http.client.HTTPException) as exc:
                with self.lock:
                    self.errors.append(f"{text}: {exc!r}")
                return  # the connection is gone
            with self.lock:
                if status == 200 and out == sim_digest("sim", 1, text):
                    self.ok += 1
                elif status == 429 and "saturated" in out:
                    self.refused += 1
                else:
                    self.errors.append(f"{text}: {status} {out}")
            if status == 429:
                time.sleep(1.0)  # its Retry-After


def test_sigkill_of_the_owner_leaves_front_end_1_serving_and_its_workers_are_adopted(
    server: ServerProc,
) -> None:
    started = worker_processes(server)
    assert len(started) == 2, started
    scale = urllib.request.Request(f"{server.admin_url}/admin/models/sim/scale?workers=3", method="POST")
    with urllib.request.urlopen(scale, timeout=10) as r:  # a slot added at runtime, as the autoscaler does
        assert r.status == 200
    wait_for(lambda: len(ready_workers(server)) == 3, 60, "three ready workers after the scale-up")
    before = worker_processes(server)
    assert len(before) == 3 and started < before, (started, before)
    front_ends = [p for p in child_pids(server.proc.pid) if alive(p)]
    (owner,) = [p for p in front_ends if set(child_pids(p)) & before]
    conns = connections_to_front_end_1(server, CLIENTS)
    try:
        with Clients(conns) as clients:
            wait_for(lambda: clients.answered() >= 100, 30, "100 answers before the kill")
            os.kill(owner, signal.SIGKILL)
            killed_at = clients.answered()
            wait_for(lambda: not alive(owner), 10, "the owner gone")
            wait_for(lambda: clients.answered() >= killed_at + 100, 30, "100 answers with the owner dead")
            wait_for(lambda: len(ready_workers(server)) == 3, 60, "the owner back with three ready workers")
            back_at = clients.answered()
            wait_for(lambda: clients.answered() >= back_at + 100, 30, "100 answers with the owner back")
        assert clients.errors == [], clients.errors[:5]
    finally:
        for conn in conns:
            conn.close()
    assert worker_processes(server) == before  # the same three: adopted, none started twice
    assert "adopted worker sim-0.0" in server.log() and "adopted worker sim-1.0" in server.log()
    assert "with worker slots {1: [0, 1, 2]}, as the previous owner" in server.log()  # the scaled-up one too
    assert "adopted worker sim-2.0" in server.log()
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(worker_processes(server) - before) == 1, 30, "the adopted worker started again")
    wait_for(lambda: len(ready_workers(server)) == 3, 30, "three ready workers again")
    after = worker_processes(server)
    assert len(after) == 3 and victim not in after, (before, after)
    wait_for(lambda: not os.path.exists(f"/proc/{victim}"), 10, "the dead worker reaped by the parent")
    server.stop()
    wait_for(lambda: not any(alive(p) for p in before | after), 10, "no worker left after shutdown")


def test_a_server_stopped_while_its_owner_is_dead_leaves_no_worker(tmp_path: Path) -> None:
    config = tmp_path / "inferd.toml"
    config.write_text(CONFIG)
    server = start_server(
        tmp_path, "--model", "sim", "--workers", "2", "--frontends", "2", "--config", str(config)
    )
    try:
        wait_for(lambda: len(ready_workers(server)) == 2, 30, "two ready workers")
        workers = worker_processes(server)
        (owner,) = [p for p in child_pids(server.proc.pid) if set(child_pids(p)) & workers]
        os.kill(owner, signal.SIGKILL)
        server.proc.send_signal(signal.SIGTERM)  # before the parent starts it again, or just after
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    wait_for(lambda: not any(alive(p) for p in workers), 10, "no worker left after shutdown")
