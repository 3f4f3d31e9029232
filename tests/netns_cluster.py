"""One server on many hosts, as the network-namespace tests build it (tests/lan.py gives the hosts): a
Redis host, front-end hosts (`inferd serve --store redis://... --workers 0`) and worker hosts (`inferd
worker --connect A,B,...`), every process real, in its own process group, logged to a file.

* `Proc` / `FrontEnd`: one process on one host (start, SIGKILL, stop, its log); a front end's URLs.
* `Cluster`: the processes of one topology; `Cluster.running()` stops them all and prints their logs'
  ends at the end, also after a failure.
* `sim_repo`, `redis_proc`, `serve_argv`, `worker_argv`: the pieces of a topology; `start_redis`.
* `PacedLoad`: checked clients (tests/checked_load.py) that pause before each request.
* Reading a front end: `get_json`, `post`, `scrape` / `metric_total` (/metrics), `workers_of` (its ready
  workers), `live` / `wait_live`, `redis_answers`; its zone routing (`zone_routing`: per zone, the
  work sent, what spilled, the shares; `by_zone`, `zone_share`).

Cutting hosts off is tests/lan.py's (`Lan.cut_off(hosts)`, `Lan.heal(hosts)`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import frontends_harness
from tests.checked_load import Load, wait_for
from tests.conftest import ROOT
from tests.lan import Host

TOKEN = "join-secret-for-many-hosts"
HTTP_PORT, ADMIN_PORT, WORKER_PORT, REDIS_PORT = 8000, 8002, 9000, 6379  # gRPC: 8001 (the default)


def sim_model_toml(
    timeout_ms: int = 10000, base_ms: float = 5.0, max_batch_size: int = 8, per_item_ms: float = 0.0,
    max_wait_ms: float = 2.0,
) -> str:
    """The `sim` model with no local workers (they come from the worker hosts)."""
    return f"""builtin = "sim"
workers = 0
max_batch_size = {max_batch_size}
max_wait_ms = {max_wait_ms:g}
default_timeout_ms = {timeout_ms}

[params]
base_ms = {base_ms}
per_item_ms = {per_item_ms}
"""


def sim_repo(root: Path, model_toml: str) -> Path:
    """A model repository with `sim` version 1, under root/repo."""
    (root / "repo" / "sim" / "1").mkdir(parents=True)
    (root / "repo" / "sim" / "model.toml").write_text(model_toml)
    return root / "repo"


@dataclass
class Proc:
    """One process on one host: started in its own process group (its local workers with it), its output
    in a log file."""

    name: str
    host: Host
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.host.argv(self.argv),
                env={**os.environ, "INFERD_JOIN_TOKEN": TOKEN},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None:
            return
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

    @contextlib.contextmanager
    def running(self, log_tail: int = 3000) -> Iterator[None]:
        """At the end, also after a failure: every process stopped, then the end of each one's log."""
        try:
            yield
        finally:
            for p in self.processes():
                p.stop()
            for p in self.processes():
                print(f"--- {p.name} (last lines)\n{p.log()[-log_tail:]}")


@dataclass
class PacedLoad(Load):
    """A Load whose clients wait `pace_s` before each request: a few hundred requests span seconds."""

    pace_s: float = 0.1

    def _next(self) -> str | None:
        time.sleep(self.pace_s)
        return super()._next()


def require_redis_server() -> str:
    """redis-server's path; a missing one fails the test (never a skip)."""
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail("redis-server is not installed: run scripts/setup --test (it installs Debian's redis-server)")
    return found


def redis_proc(host: Host, root: Path) -> Proc:
    """redis-server on `host` (no persistence: started again, it is empty)."""
    argv = [
        *(require_redis_server(), "--port", str(REDIS_PORT), "--bind", host.address),
        *("--protected-mode", "no", "--save", "", "--appendonly", "no"),
    ]
    return Proc("redis", host, argv, root / "redis.log")


def start_redis(redis: Proc) -> None:
    redis.start()
    wait_for(lambda: redis_answers(redis.host.address), 10, "redis-server answering PING")


def redis_answers(address: str) -> bool:
    try:
        with socket.create_connection((address, REDIS_PORT), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def serve_argv(fe_id: str, address: str, root: Path, redis_address: str, *extra: str) -> list[str]:
    """`inferd serve` of front end `fe_id` on `address`: the Redis host's store, no local workers, its own
    data folder; `extra` (e.g. `--zone z`, `--config path`) appended."""
    return [
        *(sys.executable, "-m", "inferd.cli.main", "serve", "--host", address, "--port", str(HTTP_PORT)),
        *("--admin-host", address, "--admin-port", str(ADMIN_PORT)),
        *("--worker-host", address, "--worker-port", str(WORKER_PORT), "--insecure"),
        *("--store", f"redis://{redis_address}:{REDIS_PORT}/0", "--data-dir", str(root / f"data-{fe_id}")),
        *("--frontend-id", fe_id, "--model-repo", str(root / "repo"), "--model", "sim", "--workers", "0"),
        *("--shutdown-grace-s", "0", *extra),
    ]


def worker_argv(worker_id: str, connect: str, *extra: str) -> list[str]:
    """`inferd worker` of `sim` joining `connect` (a comma list, or `dns:name:port`); `extra` appended."""
    return [
        *(sys.executable, "-m", "inferd.cli.main", "worker", "--connect", connect, "--model", "sim"),
        *("--worker-id", worker_id, "--insecure", *extra),
    ]


def connect_list(front_ends: list[FrontEnd]) -> str:
    """Every front end's worker port, as `--connect` takes it."""
    return ",".join(f"{fe.host.address}:{WORKER_PORT}" for fe in front_ends)


# ---- reading a front end ---------------------------------------------------------------------------------
def get_json(url: str, timeout_s: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def post(url: str, timeout_s: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def scrape(fe: FrontEnd) -> dict[str, float]:
    """Sample line (name and labels) -> value, of one /metrics scrape (tests/frontends_harness.py's)."""
    return frontends_harness.scrape(fe)  # type: ignore[arg-type]  # any object with a url


def metric_total(fe: FrontEnd, name: str) -> float:
    """The sum of a metric's samples, whatever their labels."""
    return sum(v for k, v in scrape(fe).items() if k == name or k.startswith(name + "{"))


ZONE_METRICS = {
    "sent": "inferd_requests_by_zone_total",
    "spilled": "inferd_requests_spilled_by_zone_total",
    "share": "inferd_zone_share",
}
"""What a front end's zone routing shows on /metrics: the work (batch items) it sent to each zone's workers,
of that what went beyond the zone shares (a load spill: its zone's workers were busy), and the share of its
work it gives each zone now."""


def zone_routing(fe: FrontEnd) -> dict[str, dict[str, float]]:
    """One /metrics scrape: for each of ZONE_METRICS, its samples summed by zone."""
    out: dict[str, dict[str, float]] = {key: {} for key in ZONE_METRICS}
    names = {name: key for key, name in ZONE_METRICS.items()}
    for sample, value in scrape(fe).items():
        key = names.get(sample.split("{", 1)[0])
        if key is not None:
            zone = sample.split('zone="', 1)[1].split('"', 1)[0]
            out[key][zone] = out[key].get(zone, 0.0) + value
    return out


def by_zone(fe: FrontEnd) -> dict[str, float]:
    """Work (batch items) this front end sent to each zone's workers so far."""
    return zone_routing(fe)["sent"]


def zone_share(fe: FrontEnd) -> dict[str, float]:
    """The share of its work the zone routing gives each zone now."""
    return zone_routing(fe)["share"]


def workers_of(fe: FrontEnd) -> dict[str, dict]:
    """Ready workers on this front end, by id ({} when it does not answer)."""
    try:
        rows = get_json(f"{fe.admin_url}/admin/workers", timeout_s=5)["workers"]
    except OSError:
        return {}
    return {w["worker_id"]: w for w in rows if w["state"] == "ready"}


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
