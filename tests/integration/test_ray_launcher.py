"""Workers as Ray actors (`inferd serve --ray ADDRESS`) on a local Ray cluster that this module starts on
loopback and stops: placement (one inferd_device per actor), answers, and failover of a SIGKILLed or hung
actor with every caller answered exactly once, with its own result.

Skipped only where `ray` cannot be imported (the inferd[ray] extra, which `scripts/setup --test` installs).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("ray")

from inferd.models.sim import sim_digest
from tests.conftest import ServerProc, alive, free_port, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RAY = str(Path(sys.executable).with_name("ray"))
RAY_ENV = {
    # Ray binds to the host's outward address unless told this is no cluster host (then: loopback)
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",  # newer Ray: no token authentication for this throwaway cluster
    "RAY_USAGE_STATS_ENABLED": "0",
}


@dataclass
class RayCluster:
    address: str
    session: int
    """Session id of `ray start` (its own pid): the cluster's processes are in it or below it."""
    temp_dir: str

    def free_devices(self, expect: float) -> float:
        """inferd_device units no actor holds, per the cluster's resource view (polled up to 10 s for
        `expect`: the view is eventually consistent); from a throwaway driver process."""
        script = (
            "import sys, time, ray\n"
            "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
            "assert ray.cluster_resources().get('inferd_device') == 2.0, ray.cluster_resources()\n"
            "deadline = time.monotonic() + 10\n"
            "while True:\n"
            "    free = ray.available_resources().get('inferd_device', 0.0)\n"
            "    if free == float(sys.argv[2]) or time.monotonic() > deadline:\n"
            "        break\n"
            "    time.sleep(0.1)\n"
            "print('FREE', free)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", script, self.address, str(expect)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **RAY_ENV},
        )
        m = re.search(r"^FREE ([\d.]+)$", out.stdout, re.M)
        assert m, out.stdout + out.stderr
        return float(m.group(1))

    def pids(self) -> list[int]:
        """This cluster's processes only (never another Ray on the host): its session and descendants."""
        parent: dict[int, int] = {}
        mine: set[int] = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid, ppid, sid = int(entry), int(fields[1]), int(fields[3])
            parent[pid] = ppid
            if sid == self.session:
                mine.add(pid)
        grown = True
        while grown:
            below = {p for p, pp in parent.items() if pp in mine} - mine
            grown = bool(below)
            mine |= below
        return sorted(mine)

    def stop(self) -> None:
        pids = self.pids()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                if alive(pid):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 2
            while any(alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
    port = free_port()
    start = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=2",
            "--num-gpus=0",
            '--resources={"inferd_device": 2}',
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        env={**os.environ, **RAY_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    cluster = RayCluster(f"127.0.0.1:{port}", start.pid, temp_dir)
    try:
        out, _ = start.communicate(timeout=60)
        assert start.returncode == 0, f"ray start failed:\n{out}"
        yield cluster
    finally:
        if start.poll() is None:
            start.kill()
        cluster.stop()


@pytest.fixture(scope="module")
def server(ray_cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in RAY_ENV.items():
            mp.setenv(k, v)
        mp.delenv("INFERD_JOIN_TOKEN", raising=False)  # the actors join with the server's own token
        s = start_server(
            tmp_path_factory.mktemp("ray"),
            "--model",
            "sim",
            "--workers",
            "2",
            "--ray",
            ray_cluster.address,
        )
    try:
        yield s
    finally:
        code = s.stop()
        assert code in (0, -15), s.log()


def body(text: str, rid: str) -> dict:
    return {"id": rid, "inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}


async def listed(http: aiohttp.ClientSession, server: ServerProc) -> list[dict]:
    async with http.get(f"{server.admin_url}/admin/workers") as r:
        return [w for w in (await r.json())["workers"] if w["model"] == "sim"]


async def all_ready(http: aiohttp.ClientSession, server: ServerProc, n: int) -> list[dict]:
    for _ in range(1000):
        ws = await listed(http, server)
        if sum(w["state"] == "ready" for w in ws) >= n:
            return ws
        await asyncio.sleep(0.02)
    raise AssertionError(f"sim did not get back to {n} ready workers:\n{server.log()[-3000:]}")


async def busy_worker(http: aiohttp.ClientSession, server: ServerProc) -> dict:
    for _ in range(500):
        running = [w for w in await listed(http, server) if w["inflight_batches"] > 0]
        if running:
            return running[0]
        await asyncio.sleep(0.01)
    raise AssertionError("no worker started a batch")


async def burst(http: aiohttp.ClientSession, server: ServerProc, texts: list[str]) -> list[asyncio.Future]:
    async def one(i: int, text: str) -> tuple[int, dict, dict]:
        async with http.post(f"{server.url}/v2/models/sim/infer", json=body(text, f"r{i}")) as r:
            return r.status, await r.json(), {k.lower(): v for k, v in r.headers.items()}

    return [asyncio.ensure_future(one(i, t)) for i, t in enumerate(texts)]


def check_answers(results: list, texts: list[str]) -> int:
    """Every request answered once (one response each), 200, with its own id and its own digest;
    returns how many needed a second attempt."""
    assert len(results) == len(texts)
    retried = 0
    for i, (status, payload, headers) in enumerate(results):
        assert status == 200, payload
        assert payload["id"] == f"r{i}"
        assert payload["outputs"][0]["data"] == [sim_digest("sim", 1, texts[i])]
        retried += int(headers["x-inferd-attempts"]) > 1
    return retried


async def test_actors_are_placed_one_device_each_and_answer(
    server: ServerProc, ray_cluster: RayCluster
) -> None:
    async with aiohttp.ClientSession() as http:
        ws = await all_ready(http, server, 2)
        pids = {w["pid"] for w in ws}
        assert len(pids) == 2, ws
        assert not pids & set(server.worker_pids()), "workers are Ray actors, not children of the server"
        assert pids <= set(ray_cluster.pids()), "each worker runs in a process of the Ray cluster"
        texts = [f"hello-{i}" for i in range(20)]
        assert check_answers(await asyncio.gather(*await burst(http, server, texts)), texts) == 0
    assert ray_cluster.free_devices(expect=0) == 0, "each of the 2 actors holds one of the 2 devices"


async def test_sigkilled_actor_is_failed_over_with_nothing_lost(
    server: ServerProc, ray_cluster: RayCluster
) -> None:
    async with aiohttp.ClientSession() as http:
        await all_ready(http, server, 2)
        texts = [f"kill-{i}" for i in range(200)]
        calls = await burst(http, server, texts)
        victim = await busy_worker(http, server)
        os.kill(victim["pid"], signal.SIGKILL)
        results = await asyncio.gather(*calls)
        ws = await all_ready(http, server, 2)  # the slot has a new actor
    assert check_answers(results, texts) >= 1, "the killed batch's requests show a second attempt"
    slot = victim["worker_id"].rsplit(".", 1)[0]
    (replacement,) = [w for w in ws if w["worker_id"].startswith(slot + ".")]
    assert replacement["restarts"] >= 1 and replacement["pid"] != victim["pid"], ws
    assert ray_cluster.free_devices(expect=0) == 0, "the dead actor's device went to its replacement"
    assert re.search(r"actor death", server.log()), server.log()[-3000:]


async def test_hung_actor_is_killed_through_ray_and_replaced(
    server: ServerProc, ray_cluster: RayCluster
) -> None:
    async with aiohttp.ClientSession() as http:
        await all_ready(http, server, 2)
        texts = [f"hang-{i}" for i in range(40)]
        calls = await burst(http, server, texts)
        victim = await busy_worker(http, server)
        os.kill(victim["pid"], signal.SIGSTOP)  # the watchdog's kill_worker must go through ray.kill
        try:
            results = await asyncio.gather(*calls)
            await all_ready(http, server, 2)
            for _ in range(200):  # ray.kill reaches the process through its raylet
                if not alive(victim["pid"]):
                    break
                await asyncio.sleep(0.05)
            assert not alive(victim["pid"]), "the hung actor's process was killed"
        finally:
            if alive(victim["pid"]):
                os.kill(victim["pid"], signal.SIGCONT)
    check_answers(results, texts)


async def test_scale_down_drains_an_actor_and_frees_its_device(
    server: ServerProc, ray_cluster: RayCluster
) -> None:
    async with aiohttp.ClientSession() as http:
        await all_ready(http, server, 2)
        async with http.post(f"{server.admin_url}/admin/models/sim/scale?workers=1") as r:
            assert r.status == 200, await r.text()
        for _ in range(500):
            if len(await listed(http, server)) == 1:
                break
            await asyncio.sleep(0.02)
        assert len(await listed(http, server)) == 1
        assert ray_cluster.free_devices(expect=1) == 1, "the retired actor was killed, its device freed"
        async with http.post(f"{server.admin_url}/admin/models/sim/scale?workers=2") as r:
            assert r.status == 200, await r.text()
        await all_ready(http, server, 2)
        texts = [f"scaled-{i}" for i in range(10)]
        check_answers(await asyncio.gather(*await burst(http, server, texts)), texts)


def test_unreachable_ray_cluster_fails_startup_fast(tmp_path: Path) -> None:
    """--ray at an address nobody answers: the server exits at startup with a message naming the
    address (ray.init alone would retry for minutes, leaving the server live but never ready)."""
    closed = free_port()  # bound, then released: nothing listens there
    start = time.monotonic()
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "inferd.cli.main", "serve", "--ray", f"127.0.0.1:{closed}"),
            *("--port", str(free_port()), "--no-admin", "--no-grpc", "--workers", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert f"cannot reach the Ray cluster at 127.0.0.1:{closed}" in proc.stderr + proc.stdout
    assert time.monotonic() - start < 30
