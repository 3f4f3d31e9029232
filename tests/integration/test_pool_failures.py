"""Pools through a real `inferd serve` when processes die. A model whose load kills its pool worker
(SIGKILL, as the OOM killer would) is a failed load. Its waiting request gets a 503 naming the cause and the
model backs off, instead of being loaded again and again on each restarted worker while its requests wait
(with no deadline: for good); the pool's other models are served meanwhile. A pool worker killed mid-batch
loses no other request. A front end restarted (SIGKILL) is served again by what a remote pool worker holds."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import ROOT, free_port, start_server
from tests.integration.test_pools import POOLED, body, infer, write

KILLER = """implementation = "model.py:Model"
pool = "p"
memory_mb = 10

[[inputs]]
name = "INPUT0"
datatype = "BYTES"

[[outputs]]
name = "OUTPUT0"
datatype = "BYTES"
"""
KILLER_PY = """import os
import signal

from inferd.models import base


class Model(base.Model):
    def load(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def predict_batch(self, inputs):
        raise AssertionError("never loaded")
"""
REMOTE_ONLY = """[pools.p]
workers = 0
memory_budget_mb = 130
"""
ONE_WORKER = """[pools.p]
workers = 1
memory_budget_mb = 130
min_resident_s = 0.2
"""


async def test_a_load_that_kills_its_pool_worker_fails_its_requests_and_backs_off(tmp_path: Path) -> None:
    repo, config = write(tmp_path, {"a": POOLED, "killer": KILLER}, ONE_WORKER)
    (repo / "killer" / "1").mkdir()
    (repo / "killer" / "1" / "model.py").write_text(KILLER_PY)
    server = start_server(tmp_path, "--model-repo", str(repo), "--config", str(config), "--no-grpc")
    try:
        async with aiohttp.ClientSession() as http:
            async with asyncio.timeout(15.0):  # today: held while each restarted worker dies loading it
                async with http.post(f"{server.url}/v2/models/killer/infer", json=body("x")) as r:
                    answer = await r.json()
            assert r.status == 503, answer
            assert "left while loading" in answer["error"] and int(r.headers["Retry-After"]) >= 1
            async with http.post(f"{server.url}/v2/models/killer/infer", json=body("y")) as r:
                assert r.status == 503 and int(r.headers["Retry-After"]) >= 1  # its backoff: no new load
                assert "next try is in" in (await r.json())["error"]
            await infer(http, server, "a", "after the crashes")  # the restarted worker serves the pool
    finally:
        assert server.stop() in (0, -15)


TWO_WORKERS = """[pools.p]
workers = 2
memory_budget_mb = 130
min_resident_s = 0.2
"""


async def test_a_pool_worker_killed_mid_batch_loses_no_other_request(tmp_path: Path) -> None:
    """A request that kills its pool worker mid-batch (sim's crash prefix) takes every model that worker
    held with it: the others' requests are recovered and answered, each its own, on the worker that is
    left or on the restarted one; the killer alone gets an error."""
    repo, config = write(tmp_path, {"a": POOLED, "b": POOLED}, TWO_WORKERS)
    server = start_server(tmp_path, "--model-repo", str(repo), "--config", str(config), "--no-grpc")
    try:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(infer(http, server, "a", "warm a"), infer(http, server, "b", "warm b"))

            async def killer() -> int:
                async with http.post(f"{server.url}/v2/models/a/infer", json=body("!crash now")) as r:
                    await r.read()
                    return r.status

            async with asyncio.timeout(15.0):
                outcome = await asyncio.gather(
                    killer(), *(infer(http, server, m, f"{m}-{i}") for m in "ab" for i in range(8))
                )
            assert outcome[0] == 422  # isolated, the killer is refused alone; every other answer is its own
    finally:
        assert server.stop() in (0, -15)


async def test_a_front_end_restarted_finds_the_models_its_remote_pool_worker_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool worker on another host outlives its front end: the restarted front end is served by the
    models it still holds (their model servers join again), with no new load."""
    monkeypatch.setenv("INFERD_JOIN_TOKEN", "pool-secret")
    repo, config = write(tmp_path, {"a": POOLED}, REMOTE_ONLY)
    worker_port = free_port()
    args = ("--model-repo", str(repo), "--config", str(config), "--no-grpc", "--worker-port", str(worker_port))
    server = start_server(tmp_path, *args, ready_path="/v2/health/live")
    worker = start_pool_worker(tmp_path, worker_port)
    try:
        async with aiohttp.ClientSession() as http:
            await ready(http, server.url, "/v2/models/a/ready")  # the server is ready at once: the pool's is a join
            await infer(http, server, "a", "before")
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(10)
            assert worker.poll() is None, "the remote pool worker outlives its front end"
            server = start_server(tmp_path, *args, "--port", str(server.port), ready_path="/v2/health/live")
            await ready(http, server.url, "/v2/models/a/ready")  # the server is ready at once: the pool's is a join
            async with asyncio.timeout(10.0):
                while True:  # its pool link and its model server of "a" join again
                    async with http.get(f"{server.admin_url}/admin/pools") as r:
                        [pool] = (await r.json())["pools"]
                    if [m["serving"] for m in pool["models"]] == [1]:
                        break
                    await asyncio.sleep(0.05)
            await infer(http, server, "a", "after")
            async with http.get(f"{server.url}/metrics") as r:
                assert 'inferd_model_loads_total{model="a"} 1.0' in await r.text()  # not loaded again
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(15) == 0
        assert server.stop() in (0, -15)


async def ready(http: aiohttp.ClientSession, url: str, path: str = "/v2/health/ready") -> None:
    """Until `path` answers 200: a pooled model's ready route once its pool has a worker (the server's
    readiness never waits for a pool: runtime/readiness.py)."""
    async with asyncio.timeout(15.0):
        while True:
            async with http.get(f"{url}{path}") as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.05)


def start_pool_worker(tmp_path: Path, port: int) -> subprocess.Popen[bytes]:
    """`inferd worker --pool p` on "another host" (its log in tmp_path)."""
    with open(tmp_path / "pool-worker.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "inferd.cli.main", "worker", "--pool", "p", "--connect", f"127.0.0.1:{port}",
             "--worker-id", "remote-pool"],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
