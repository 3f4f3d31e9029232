"""One server on many hosts, with real processes in network namespaces (tests/lan.py): three front-end
hosts, two worker hosts and a Redis host on one bridge, each host its own address. The front ends share
their served state in the Redis host's redis-server (`--store redis://...`) and take no local workers
(`--workers 0`); the workers join them over TCP: one through a comma list of all three, one through a
DNS name (`--connect dns:routers:9000`) that resolves, inside its host, to the first two front ends
only (`Host.resolve`: /etc/netns/<ns>/hosts, read by getaddrinfo).

One topology for the module, built once; the scenarios run on it in order:
  1. SIGKILL of a front end under load: the clients of the other two get every answer, once, their own;
     the killed one's clients get only answers that are theirs; the front end started again takes
     workers and requests;
  2. Redis stopped for 10 s and started again (empty: no persistence): every front end goes on
     answering, shows `inferd_cluster_store_up 0`, and refuses changes with 503 naming the store; once
     Redis answers, each shows 1, a reload reaches all three, one holds the lease again, and an update
     asked of any front end is carried out and seen the same on all three;
  3. the name is changed to add the third front end: the DNS worker joins it, with its zone.

Every load is capped in count and time, every wait bounded; every process is stopped and every
namespace removed at the end, also after a failure."""

from __future__ import annotations

import asyncio
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

from inferd.cluster.redis_store import RedisStore
from inferd.cluster.served import SERVED, ModelServed, ServedState, serving_reports
from tests.checked_load import Load, assert_exactly_once, infer, tally, wait_answers, wait_for
from tests.conftest import ROOT
from tests.lan import Host, Lan

TOKEN = "join-secret-for-many-hosts"
NAME = "routers"
HTTP_PORT, ADMIN_PORT, WORKER_PORT, REDIS_PORT = 8000, 8002, 9000, 6379  # gRPC: 8001 (the default)
MODEL_TOML = """builtin = "sim"
workers = 0
max_batch_size = 8
max_wait_ms = 2
default_timeout_ms = 10000

[params]
base_ms = 5.0
per_item_ms = 0.0
"""


@dataclass
class Proc:
    """One process on one host: started in its own process group, its output in a log file."""

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
        """SIGTERM to its process group, SIGKILL after 15 s."""
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.proc.wait(10)
        self.kill(signal.SIGKILL)  # anything it left in its group

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


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
    lan: Lan
    root: Path
    redis: Proc
    front_ends: list[FrontEnd]
    workers: list[Proc] = field(default_factory=list)

    def processes(self) -> list[Proc]:
        return [*self.workers, *self.front_ends, self.redis]


@dataclass
class PacedLoad(Load):
    """A Load whose clients wait `pace_s` before each request: a few hundred requests span seconds."""

    pace_s: float = 0.1

    def _next(self) -> str | None:
        time.sleep(self.pace_s)
        return super()._next()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def post(url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def scrape(fe: FrontEnd) -> dict[str, float]:
    with urllib.request.urlopen(f"{fe.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metric_total(fe: FrontEnd, name: str) -> float:
    return sum(v for k, v in scrape(fe).items() if k == name or k.startswith(name + "{"))


def workers_of(fe: FrontEnd) -> dict[str, dict]:
    """Ready workers on this front end, by id."""
    try:
        rows = get_json(f"{fe.admin_url}/admin/workers")["workers"]
    except OSError:
        return {}
    return {w["worker_id"]: w for w in rows if w["state"] == "ready"}


def holds(fe: FrontEnd) -> bool:
    return scrape(fe).get("inferd_cluster_lease_holder") == 1.0


def store_up(fe: FrontEnd) -> float | None:
    return scrape(fe).get("inferd_cluster_store_up")


def redis_answers(address: str) -> bool:
    try:
        with socket.create_connection((address, REDIS_PORT), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


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


def served_state(fe: FrontEnd) -> dict:
    """What /admin/models says this front end serves: per model row, its version and whether default."""
    page = get_json(f"{fe.admin_url}/admin/models")
    return {key: (row["version"], row["default"]) for key, row in page["models"].items()}


def in_store(address: str) -> tuple[ServedState, dict[str, tuple[dict, int]]]:
    """What the Redis host holds: the served document, and each front end's report of what it serves
    (`serving/<frontend>`: per model its versions and default, and the config generation it read)."""

    async def read() -> tuple[ServedState, dict[str, tuple[dict, int]]]:
        store = RedisStore(f"redis://{address}:{REDIS_PORT}/0", timeout_s=2.0)
        try:
            _, served = await SERVED.read(store)
            found = [r for _, r in (await serving_reports(store, "").others()).values()]
        finally:
            await store.close()
        return served, {
            r.frontend: ({m: (s.versions, s.default) for m, s in r.models.items()}, r.generation) for r in found
        }

    return asyncio.run(read())


def converged(address: str, ids: list[str]) -> bool:
    """The served document says sim version 1 is served and the default, and every front end reports
    serving just that, at the document's config generation."""
    served, serving = in_store(address)
    return served.models == {"sim": ModelServed([1], 1, [])} and serving == {
        fe: ({"sim": ([1], 1)}, served.generation) for fe in ids
    }


def serve_argv(fe_id: str, address: str, zone: str, root: Path, redis_address: str) -> list[str]:
    return [
        *(sys.executable, "-m", "inferd.cli.main", "serve", "--host", address, "--port", str(HTTP_PORT)),
        *("--admin-host", address, "--admin-port", str(ADMIN_PORT)),
        *("--worker-host", address, "--worker-port", str(WORKER_PORT), "--insecure"),
        *("--store", f"redis://{redis_address}:{REDIS_PORT}/0", "--data-dir", str(root / f"data-{fe_id}")),
        *("--zone", zone, "--frontend-id", fe_id, "--model-repo", str(root / "repo"), "--model", "sim"),
        *("--workers", "0", "--config", str(root / "inferd.toml"), "--shutdown-grace-s", "0"),
    ]


def worker_argv(worker_id: str, connect: str, zone: str) -> list[str]:
    return [
        *(sys.executable, "-m", "inferd.cli.main", "worker", "--connect", connect, "--model", "sim"),
        *("--worker-id", worker_id, "--zone", zone, "--insecure"),
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.fail("redis-server is not installed: run scripts/setup --test (it installs Debian's redis-server)")
    root = tmp_path_factory.mktemp("hosts")
    (root / "repo" / "sim" / "1").mkdir(parents=True)
    (root / "repo" / "sim" / "model.toml").write_text(MODEL_TOML)
    (root / "inferd.toml").write_text("")
    with Lan() as lan:
        fe_hosts = [lan.host(f"fe-{x}") for x in "abc"]
        w_hosts = [lan.host(f"wk-{i}") for i in (1, 2)]
        redis_host = lan.host("redis")
        redis = Proc(
            "redis",
            redis_host,
            [
                redis_server, "--port", str(REDIS_PORT), "--bind", redis_host.address,
                "--protected-mode", "no", "--save", "", "--appendonly", "no",
            ],
            root / "redis.log",
        )
        front_ends = [
            FrontEnd(f"fe-{x}", h, serve_argv(f"fe-{x}", h.address, zone, root, redis_host.address),
                     root / f"fe-{x}.log", id=f"fe-{x}")
            for x, h, zone in zip("abc", fe_hosts, ("zone-a", "zone-b", "zone-a"), strict=True)
        ]
        c = Cluster(lan, root, redis, front_ends)
        try:
            redis.start()
            wait_for(lambda: redis_answers(redis_host.address), 10, "redis-server answering PING")
            for fe in front_ends:
                fe.start()
            for fe in front_ends:
                wait_live(fe)
            everyone = ",".join(f"{h.address}:{WORKER_PORT}" for h in fe_hosts)
            w_hosts[1].resolve({NAME: [h.address for h in fe_hosts[:2]]})  # before the worker starts there
            c.workers = [
                Proc("w1", w_hosts[0], worker_argv("w1", everyone, "zone-a"), root / "w1.log"),
                Proc(
                    "w2", w_hosts[1],
                    [*worker_argv("w2", f"dns:{NAME}:{WORKER_PORT}", "zone-b"), "--resolve-every-s", "0.5"],
                    root / "w2.log",
                ),
            ]
            for w in c.workers:
                w.start()
            a, b, fe_c = front_ends
            wait_for(lambda: set(workers_of(a)) == set(workers_of(b)) == {"w1", "w2"}, 60, "w1 and w2 on a and b")
            wait_for(lambda: set(workers_of(fe_c)) == {"w1"}, 60, "w1 on c")
            wait_for(lambda: sum(holds(fe) for fe in front_ends) == 1, 30, "one front end holding the lease")
            yield c
        finally:
            for p in c.processes():
                p.stop()
            for p in c.processes():
                print(f"--- {p.name} (last lines)\n{p.log()[-2000:]}" if p.log_path.exists() else "")


def test_sigkill_of_a_front_end_fails_only_its_own_requests(cluster: Cluster) -> None:
    holder = [fe for fe in cluster.front_ends if holds(fe)]
    victim = next(fe for fe in reversed(cluster.front_ends) if fe not in holder)  # not the lease holder
    others = [fe for fe in cluster.front_ends if fe is not victim]
    counters = ("inferd_batch_failures_total", "inferd_retried_items_total")
    before = {(fe.id, name): metric_total(fe, name) for fe in others for name in counters}
    joined = {fe.id: set(workers_of(fe)) for fe in others}
    loads = {fe.id: Load(fe.url, f"kill-{fe.id}", clients=2, max_requests=120, max_s=40) for fe in cluster.front_ends}
    with loads["fe-a"], loads["fe-b"], loads["fe-c"]:
        for load in loads.values():
            wait_answers(load, 15)
        victim.kill()
        victim.proc.wait(10)
        for fe in others:
            loads[fe.id].finish(60)
    for fe in others:
        t = tally(loads[fe.id])
        assert_exactly_once(t, loads[fe.id])
        assert t.ok == t.sent == 120, (fe.id, t)
        for name in counters:  # no batch of theirs was lost or sent again
            assert metric_total(fe, name) == before[fe.id, name], (fe.id, name)
    t = tally(loads[victim.id])
    assert t.duplicated == 0 and t.misrouted == 0, t  # what its clients got was theirs
    assert t.ok >= 15 and t.sent > t.ok, t  # answered until killed, then refused connections
    for w in cluster.workers:
        assert w.alive(), f"worker {w.name} exited:\n{w.log()[-3000:]}"
    for fe in others:
        assert set(workers_of(fe)) == joined[fe.id], f"{fe.id}'s workers changed"

    victim.start()  # the same front end started again (same id, address and data folder)
    wait_live(victim)
    wait_for(lambda: "w1" in workers_of(victim), 60, f"w1 joining {victim.id} again")
    answers = [infer(victim.url, f"back-{i}") for i in range(20)]
    assert all(a is not None and a.correct for a in answers), answers


def test_redis_stopped_for_10s_then_started_again(cluster: Cluster) -> None:
    fes = cluster.front_ends
    for fe in fes:
        wait_live(fe)
    wait_for(lambda: all(store_up(fe) == 1.0 for fe in fes), 20, "the store up on every front end")
    wait_for(lambda: sum(holds(fe) for fe in fes) == 1, 30, "one holder")
    before = {fe.id: served_state(fe) for fe in fes}
    assert before["fe-a"] == before["fe-b"] == before["fe-c"] == {"sim": (1, True)}, before

    store_url = f"redis://{cluster.redis.host.address}:{REDIS_PORT}/0"
    loads = {fe.id: PacedLoad(fe.url, f"outage-{fe.id}", clients=1, max_requests=300, max_s=45) for fe in fes}
    cluster.redis.stop()
    stopped_at = time.monotonic()
    with loads["fe-a"], loads["fe-b"], loads["fe-c"]:
        wait_for(lambda: all(store_up(fe) == 0.0 for fe in fes), 15, "the store seen down on every front end")
        wait_for(lambda: not any(holds(fe) for fe in fes), 15, "no front end acting as holder")
        for fe in fes:
            for change in ("scale?workers=1", "update?version=1"):
                status, answer = post(f"{fe.admin_url}/admin/models/sim/{change}")
                named = f"the cluster store does not answer (the cluster store at {store_url}"
                assert status == 503 and named in answer["error"], (fe.id, change, status, answer)
        for load in loads.values():
            wait_answers(load, 10)  # answered while the store is down
        assert all(store_up(fe) == 0.0 for fe in fes)
        time.sleep(max(0.0, 10.0 - (time.monotonic() - stopped_at)))  # 10 s of outage
        cluster.redis.start()  # on the same address and port, empty
        wait_for(lambda: redis_answers(cluster.redis.host.address), 10, "redis-server answering again")
        wait_for(lambda: all(store_up(fe) == 1.0 for fe in fes), 20, "the store up again on every front end")
        for load in loads.values():
            wait_answers(load, 10)  # answered once the store is back
    for fe in fes:
        t = tally(loads[fe.id])
        assert_exactly_once(t, loads[fe.id])
        assert t.ok == t.sent, (fe.id, t)

    # converged: a reload reaches all three, one holds the lease, a change asked of any is carried out
    ids = sorted(fe.id for fe in fes)
    def reloaded() -> list[str]:
        status, answer = post(f"{fes[0].admin_url}/admin/reload")
        return sorted(answer["frontends"]["reloaded"]) if status == 200 else []

    wait_for(lambda: reloaded() == ids, 30, "a reload reaching every front end")
    wait_for(lambda: sum(holds(fe) for fe in fes) == 1, 30, "a holder again")
    for fe in fes:
        status, answer = post(f"{fe.admin_url}/admin/models/sim/update?version=1")
        assert status == 200, (fe.id, status, answer)
    wait_for(lambda: all(served_state(fe) == before[fe.id] for fe in fes), 10, "the same served state everywhere")
    wait_for(lambda: converged(cluster.redis.host.address, ids), 10, "the served state in the store, reported by all")
    for fe in fes:
        answers = [infer(fe.url, f"after-{fe.id}-{i}") for i in range(10)]
        assert all(a is not None and a.correct for a in answers), answers


def test_a_dns_worker_joins_a_front_end_added_to_the_name(cluster: Cluster) -> None:
    a, b, c = cluster.front_ends
    w2 = cluster.workers[1]
    wait_for(lambda: "w2" in workers_of(a) and "w2" in workers_of(b), 60, "w2 on a and b")
    assert "w2" not in workers_of(c)  # not in the name yet
    w2.host.resolve({NAME: [fe.host.address for fe in cluster.front_ends]})
    wait_for(lambda: "w2" in workers_of(c), 30, "w2 joining the front end added to the name")
    page = get_json(f"{c.admin_url}/admin/workers")
    assert page["frontend"] == {"id": "fe-c", "zone": "zone-a"}
    zones = {w["worker_id"]: w["zone"] for w in page["workers"]}
    assert zones == {"w1": "zone-a", "w2": "zone-b"}, zones
    assert {"w1", "w2"} <= set(workers_of(a)) and {"w1", "w2"} <= set(workers_of(b))  # still on the others
    with Load(c.url, "dns", clients=2, max_requests=60, max_s=30) as load:
        load.finish(30)
    t = tally(load)
    assert_exactly_once(t, load)
    assert t.ok == 60, t
    assert w2.alive()
