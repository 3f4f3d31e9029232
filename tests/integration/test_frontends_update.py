"""A rolling update with `inferd serve --frontends 2`: the owner runs it, and the other front end follows
(frontends/version_sync.py): it serves the new version before the new workers join it, moves its default
with the owner's, and retires the old version with it. Under checked load (each request on a new
connection, so both front ends take them): every answer is a 200 whose digest is its version's, every
request sent once the update answered is answered by version 2, on both front ends; a follower killed
after the update comes back serving version 2.

Bounded: one server, a load capped in count and time, every wait bounded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from inferd.models.sim import sim_digest
from tests.checked_load import wait_for
from tests.conftest import ServerProc, alive, child_pids, start_server
from tests.frontends_harness import ready_workers, scrape
from tests.integration.test_frontends import frontend_pids

MODEL_TOML = """builtin = "sim"
workers = 2
max_batch_size = 8
max_wait_ms = 2

[params]
base_ms = 10.0
"""


@dataclass(frozen=True)
class Reply:
    text: str
    status: int
    version: str
    correct: bool
    sent_at: float


@dataclass
class VersionedLoad:
    """Closed-loop clients, a new connection per request; each answer checked against its version."""

    url: str
    clients: int = 4
    max_requests: int = 4000
    max_s: float = 40.0
    replies: list[Reply] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    _sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> VersionedLoad:
        until = time.monotonic() + self.max_s
        self._threads = [
            threading.Thread(target=self._client, args=(until,), daemon=True) for _ in range(self.clients)
        ]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def answered(self) -> int:
        with self._lock:
            return len(self.replies)

    def _client(self, until: float) -> None:
        while True:
            with self._lock:
                if self._stop.is_set() or self._sent >= self.max_requests or time.monotonic() > until:
                    return
                self._sent += 1
                text = f"u-{self._sent}"
            reply = ask(self.url, text)
            with self._lock:
                if reply is None:
                    self.unanswered.append(text)
                else:
                    self.replies.append(reply)


def ask(url: str, text: str) -> Reply | None:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]})
    req = urllib.request.Request(
        f"{url}/v2/models/sim/infer", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    sent_at = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            version = r.headers["X-Inferd-Model-Version"]
            output = json.loads(r.read())["outputs"][0]["data"][0]
            return Reply(text, r.status, version, output == sim_digest("sim", int(version), text), sent_at)
    except urllib.error.HTTPError as exc:
        return Reply(text, exc.code, exc.read().decode(errors="replace"), False, sent_at)
    except OSError:
        return None


def ok_v2(sample: dict[str, float], frontend: str) -> float:
    return sum(
        v
        for k, v in sample.items()
        if k.startswith("inferd_requests_total{")
        and f'frontend="{frontend}"' in k
        and 'version="2"' in k
        and 'outcome="ok"' in k
    )


def restarted(server: ServerProc, owner: int, killed: int) -> bool:
    return bool(
        {p for p in child_pids(server.proc.pid) if alive(p) and child_pids(p) == []} - {owner, killed}
    )


def update(server: ServerProc) -> tuple[int, dict]:
    req = urllib.request.Request(f"{server.admin_url}/admin/models/sim/update", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_rolling_update_reaches_every_front_end(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "sim" / "1").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text(MODEL_TOML)
    server = start_server(tmp_path, "--model-repo", str(repo), "--frontends", "2")
    try:
        wait_for(lambda: len(ready_workers(server)) == 2, 30, "two ready workers")
        with VersionedLoad(server.url) as load:
            wait_for(lambda: load.answered() >= 40, 20, "answers before the update")
            shutil.copytree(repo / "sim" / "1", repo / "sim" / "2")
            status, result = update(server)
            updated_at = time.monotonic()
            seen = load.answered()
            wait_for(lambda: load.answered() >= seen + 100, 20, "answers after the update")
        assert (status, result) == (200, {"model": "sim", "from": 1, "to": 2, "replaced": 2})
        assert sorted(w["version"] for w in ready_workers(server)) == [2, 2]
        assert not load.unanswered, load.unanswered[:5]
        failed = [r for r in load.replies if r.status != 200 or not r.correct]
        assert not failed, failed[:5]
        after = [r.version for r in load.replies if r.sent_at > updated_at]
        assert len(after) >= 50 and set(after) == {"2"}
        assert {"1", "2"} <= {r.version for r in load.replies}
        sample = scrape(server)
        assert ok_v2(sample, "0") > 0 and ok_v2(sample, "1") > 0, {
            k: v for k, v in sample.items() if k.startswith("inferd_requests_total")
        }

        owner, follower = frontend_pids(server)
        os.kill(follower, signal.SIGKILL)
        wait_for(lambda: restarted(server, owner, follower), 20, "the killed front end started again")
        replies = []
        deadline = time.monotonic() + 30
        while ok_v2(scrape(server), "1") == 0 and time.monotonic() < deadline:  # its counters start anew
            replies += [ask(server.url, f"r-{len(replies)}") for _ in range(10)]
        assert ok_v2(scrape(server), "1") > 0, "the restarted front end answered nothing with version 2"
        wrong = [r for r in replies if r is None or r.status != 200 or not r.correct or r.version != "2"]
        assert not wrong, wrong[:5]
    finally:
        assert server.stop() in (0, -15)
    assert "is not served" not in server.log()
