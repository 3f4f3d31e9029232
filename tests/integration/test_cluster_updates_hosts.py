"""Rolling updates of one server on many hosts, with real processes in network namespaces (tests/lan.py):
three front-end hosts, two worker hosts and a Redis host on one bridge. The front ends share their served
state in the Redis host's redis-server (`--store redis://...`), take no local workers of the configured
version (`--workers 0`) and have the same join token; each worker host runs `inferd worker --connect
A,B,C --model sim` (no --model-version: it serves the default version). The model repository (one
folder, seen by every host) gains version 2, then 3, as the scenarios need them.

One topology for the module, built once; the scenarios run on it in order:
  1. an update to version 2 asked of a front end that does not hold the lease (forwarded to the holder)
     under load on all three front ends: every request answered once, 200, by the version it names; the
     holder's new worker joins every front end, the workers on the worker hosts join again at version 2,
     every front end shows the same fleet, and an unversioned request answers `model_version` "2"
     everywhere;
  2. SIGKILL of the lease holder during an update to version 3: another front end takes the lease and
     ends the update where the served state's default was (finished or undone); every live front end
     serves that one version, with ready workers, and answers with it;
  3. the same once the default has moved (requests pinned to the old version keep the update waiting
     before it retires it): the new holder finishes the update, and the workers on the worker hosts,
     whose version it retires, join again at the new one (the dead holder's new worker is gone with it).

Every load is capped in count and time, every wait bounded; every process is stopped and every
namespace removed at the end, also after a failure."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.checked_load import Load, tally, wait_answers, wait_for
from tests.conftest import ROOT
from tests.lan import Host, Lan

TOKEN = "join-secret-for-updates-on-many-hosts"
HTTP_PORT, ADMIN_PORT, WORKER_PORT, REDIS_PORT = 8000, 8002, 9000, 6379  # gRPC: 8001 (the default)
MODEL_TOML = """builtin = "sim"
workers = 0
max_batch_size = 8
max_wait_ms = 2
default_timeout_ms = 20000

[params]
base_ms = 5.0
per_item_ms = 0.0
"""


@dataclass
class Proc:
    """One process on one host, in its own process group (its local workers with it), logged to a file."""

    name: str
    host: Host
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.host.argv(self.argv), env={**os.environ, "INFERD_JOIN_TOKEN": TOKEN}, stdout=log,
                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 15 s (and to whatever it left in its group)."""
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.proc.wait(10)
        self.kill(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class FrontEnd(Proc):
    id: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{HTTP_PORT}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host.address}:{ADMIN_PORT}"


@dataclass
class Cluster:
    root: Path
    redis: Proc
    front_ends: list[FrontEnd]
    workers: list[Proc] = field(default_factory=list)

    def processes(self) -> list[Proc]:
        return [*self.workers, *self.front_ends, self.redis]

    def live(self) -> list[FrontEnd]:
        return [fe for fe in self.front_ends if fe.alive()]

    def holder(self) -> FrontEnd | None:
        """The live front end that holds the lease, as every live one names it (None: not agreed yet)."""
        named = {cluster_page(fe).get("holder") for fe in self.live()}
        found = [fe for fe in self.live() if {fe.id} == named]
        return found[0] if found else None

    def add_version(self, version: int) -> None:
        (self.root / "repo" / "sim" / str(version)).mkdir()


@dataclass
class PacedLoad(Load):
    """A Load whose clients wait `pace_s` before each request: a few hundred requests span seconds."""

    pace_s: float = 0.05

    def _next(self) -> str | None:
        time.sleep(self.pace_s)
        return super()._next()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def post(url: str, timeout_s: float = 90) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def cluster_page(fe: FrontEnd) -> dict:
    try:
        return get_json(f"{fe.admin_url}/admin/cluster")
    except OSError:
        return {}


def models_page(fe: FrontEnd) -> dict:
    try:
        return get_json(f"{fe.admin_url}/admin/models")["models"]
    except OSError:
        return {}


def served(fe: FrontEnd) -> dict[int, bool]:
    """version -> default, as this front end's /admin/models says."""
    return {row["version"]: row["default"] for row in models_page(fe).values()}


def fleet(fe: FrontEnd) -> list[dict]:
    """The model's workers (every version's) as this front end's /admin/models shows them."""
    rows = list(models_page(fe).values())
    return rows[0]["fleet"] if rows else []


def ready_at(fe: FrontEnd, version: int) -> set[str]:
    return {w["worker_id"] for w in fleet(fe) if w["version"] == version and w["state"] == "ready"}


def answer(fe: FrontEnd, text: str) -> tuple[int, str | None]:
    """An unversioned request: its status and the model_version the OIP answer names."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}).encode()
    req = urllib.request.Request(f"{fe.url}/v2/models/sim/infer", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read()).get("model_version")
    except urllib.error.HTTPError as exc:
        return exc.code, None


def live(fe: FrontEnd) -> bool:
    try:
        with urllib.request.urlopen(f"{fe.url}/v2/health/live", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_live(fe: FrontEnd, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while not live(fe):
        assert fe.alive(), f"front end {fe.id} exited:\n{fe.log()[-4000:]}"
        assert time.monotonic() < deadline, f"front end {fe.id} not live within {within_s}s:\n{fe.log()[-4000:]}"
        time.sleep(0.1)


def redis_answers(address: str) -> bool:
    try:
        with socket.create_connection((address, REDIS_PORT), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def serve_argv(fe_id: str, address: str, root: Path, redis_address: str) -> list[str]:
    return [
        *(sys.executable, "-m", "inferd.cli.main", "serve", "--host", address, "--port", str(HTTP_PORT)),
        *("--admin-host", address, "--admin-port", str(ADMIN_PORT)),
        *("--worker-host", address, "--worker-port", str(WORKER_PORT), "--insecure"),
        *("--store", f"redis://{redis_address}:{REDIS_PORT}/0", "--data-dir", str(root / f"data-{fe_id}")),
        *("--frontend-id", fe_id, "--model-repo", str(root / "repo"), "--model", "sim", "--workers", "0"),
        *("--shutdown-grace-s", "0"),
    ]


def worker_argv(worker_id: str, connect: str) -> list[str]:
    return [
        *(sys.executable, "-m", "inferd.cli.main", "worker", "--connect", connect, "--model", "sim"),
        *("--worker-id", worker_id, "--insecure"),
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.fail("redis-server is not installed: run scripts/setup --test (it installs Debian's redis-server)")
    root = tmp_path_factory.mktemp("updates-hosts")
    (root / "repo" / "sim" / "1").mkdir(parents=True)
    (root / "repo" / "sim" / "model.toml").write_text(MODEL_TOML)
    with Lan() as lan:
        fe_hosts = [lan.host(f"up-{x}") for x in "abc"]
        w_hosts = [lan.host(f"upw-{i}") for i in (1, 2)]
        redis_host = lan.host("upredis")
        redis = Proc(
            "redis", redis_host,
            [redis_server, "--port", str(REDIS_PORT), "--bind", redis_host.address, "--protected-mode", "no",
             "--save", "", "--appendonly", "no"],
            root / "redis.log",
        )
        front_ends = [
            FrontEnd(f"fe-{x}", h, serve_argv(f"fe-{x}", h.address, root, redis_host.address), root / f"fe-{x}.log", id=f"fe-{x}")
            for x, h in zip("abc", fe_hosts, strict=True)
        ]
        c = Cluster(root, redis, front_ends)
        try:
            redis.start()
            wait_for(lambda: redis_answers(redis_host.address), 10, "redis-server answering PING")
            for fe in front_ends:
                fe.start()
            for fe in front_ends:
                wait_live(fe)
            everyone = ",".join(f"{h.address}:{WORKER_PORT}" for h in fe_hosts)
            c.workers = [Proc(f"w{i}", h, worker_argv(f"w{i}", everyone), root / f"w{i}.log") for i, h in enumerate(w_hosts, 1)]
            for w in c.workers:
                w.start()
            wait_for(lambda: all(ready_at(fe, 1) == {"w1", "w2"} for fe in front_ends), 60, "w1 and w2 on every front end")
            wait_for(lambda: c.holder() is not None, 30, "one front end holding the lease, named by all")
            yield c
        finally:
            for p in c.processes():
                p.stop()
            for p in c.processes():
                print(f"--- {p.name} (last lines)\n{p.log()[-3000:]}")


def test_an_update_asked_of_a_front_end_without_the_lease_is_served_by_every_front_end(cluster: Cluster) -> None:
    holder = cluster.holder()
    assert holder is not None
    asker = next(fe for fe in cluster.front_ends if fe is not holder)  # forwarded to the holder
    cluster.add_version(2)
    loads = [PacedLoad(fe.url, f"u1-{fe.id}", clients=2, max_requests=600, max_s=60) for fe in cluster.front_ends]
    for load in loads:
        load.__enter__()
    try:
        for load in loads:
            wait_answers(load, 10)
        status, result = post(f"{asker.admin_url}/admin/models/sim/update?version=2")
        assert (status, result) == (200, {"model": "sim", "from": 1, "to": 2, "replaced": 0}), result
        # the workers on the worker hosts, told version 1 is retired, join every front end again at 2
        wait_for(lambda: all({"w1", "w2"} <= ready_at(fe, 2) for fe in cluster.front_ends), 60, "w1, w2 at version 2")
        for load in loads:
            wait_answers(load, 20)
    finally:
        for load in loads:
            load.__exit__()
    for load in loads:
        t = tally(load)
        assert not load.unanswered and t.lost == 0 and t.duplicated == 0, (load.tag, load.unanswered[:5], t)
        assert t.ok == t.sent and t.misrouted == 0, (load.tag, [a for a in load.answers if not a.correct][:5])
        assert {a.version for a in load.answers} == {"1", "2"}, load.tag  # served by both, never failed
    holders_worker = ready_at(holder, 2) - {"w1", "w2"}
    assert len(holders_worker) == 1, fleet(holder)  # the holder's new local worker
    wait_for(lambda: len({json.dumps(fleet(fe)) for fe in cluster.front_ends}) == 1, 20, "the same fleet everywhere")
    for fe in cluster.front_ends:
        assert served(fe) == {2: True}, (fe.id, models_page(fe))
        assert ready_at(fe, 2) == {"w1", "w2", *holders_worker}, (fe.id, fleet(fe))
        assert answer(fe, f"after-{fe.id}") == (200, "2")
    for w in cluster.workers:
        assert "its version is no longer served: joining again at the default version" in w.log(), w.name


def test_sigkill_of_the_lease_holder_mid_update_leaves_no_version_without_workers(cluster: Cluster) -> None:
    holder = cluster.holder()
    assert holder is not None
    asker = next(fe for fe in cluster.front_ends if fe is not holder)
    cluster.add_version(3)
    asked: list[tuple[int, dict] | BaseException] = []

    def ask() -> None:
        try:
            asked.append(post(f"{asker.admin_url}/admin/models/sim/update?version=3"))
        except (OSError, ValueError) as exc:  # the forwarded update's holder died under it
            asked.append(exc)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    wait_for(lambda: 3 in served(asker), 30, "version 3 served beside 2 (the update running)")
    holder.kill()  # its process group: the front end and its local workers
    holder.proc.wait(10)  # type: ignore[union-attr]
    survivors = cluster.live()
    assert holder not in survivors and len(survivors) == 2
    wait_for(lambda: cluster.holder() in survivors, 30, "another front end holding the lease")

    def settled() -> bool:
        pages = [served(fe) for fe in survivors]
        return all(len(p) == 1 and next(iter(p.values())) for p in pages) and len({json.dumps(p) for p in pages}) == 1

    wait_for(settled, 60, "the update ended the same way on every live front end")
    (default,) = served(survivors[0])
    assert default in (2, 3)  # finished (past its first new worker) or undone (before it)
    settler = cluster.holder()
    assert settler is not None and f"the update 2 -> 3 the last holder left ends at {default}" in settler.log()
    # no version left without workers: the workers on the worker hosts serve it on every live front end
    wait_for(lambda: all({"w1", "w2"} <= ready_at(fe, default) for fe in survivors), 60, f"w1, w2 at version {default}")
    for fe in survivors:
        for i in range(5):
            assert answer(fe, f"settled-{fe.id}-{i}") == (200, str(default))
    print(f"\nthe update to 3 ended at version {default} once {holder.id} was killed")
    thread.join(120)
    assert not thread.is_alive() and len(asked) == 1
    print(f"the asked front end answered: {asked[0]!r}")
    if isinstance(asked[0], tuple):  # answered: refused (503) or, had it ended first, done
        assert asked[0][0] in (200, 503), asked[0]


def test_sigkill_of_the_lease_holder_once_the_default_moved_finishes_the_update(cluster: Cluster) -> None:
    holder = cluster.holder()
    assert holder is not None
    (asker,) = [fe for fe in cluster.live() if fe is not holder]
    old = next(iter(served(asker)))
    new = 3 if old == 2 else 2  # the last scenario's update ended at 2 (undone) or at 3 (finished)
    stop = threading.Event()

    def pinned_to_old() -> None:  # work of the old version keeps the update from retiring it (<= 10 s)
        body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}).encode()
        url = f"{asker.url}/v2/models/sim/versions/{old}/infer"
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}), timeout=20).read()
            except OSError:  # retired under it: not this scenario's concern
                time.sleep(0.05)

    busy = [threading.Thread(target=pinned_to_old, daemon=True) for _ in range(8)]
    for t in busy:
        t.start()
    asked: list[object] = []
    thread = threading.Thread(
        target=lambda: asked.append(_post_or_error(f"{asker.admin_url}/admin/models/sim/update?version={new}")),
        daemon=True,
    )
    try:
        thread.start()
        wait_for(lambda: served(asker) == {old: False, new: True}, 60, f"the default moved to {new}, {old} still served")
        holder.kill()
        holder.proc.wait(10)  # type: ignore[union-attr]
    finally:
        stop.set()
    for t in busy:
        t.join(30)
    wait_for(lambda: cluster.holder() is asker, 30, "the last front end holding the lease")
    wait_for(lambda: served(asker) == {new: True}, 30, f"the update finished at {new}")
    assert f"the update {old} -> {new} the last holder left ends at {new}" in asker.log()
    wait_for(lambda: {"w1", "w2"} <= ready_at(asker, new), 60, f"w1, w2 joined again at version {new}")
    for i in range(5):
        assert answer(asker, f"finished-{i}") == (200, str(new))
    thread.join(120)
    assert not thread.is_alive() and len(asked) == 1


def _post_or_error(url: str) -> object:
    try:
        return post(url)
    except (OSError, ValueError) as exc:
        return exc
