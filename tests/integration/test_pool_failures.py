"""Pools through a real `inferd serve` when a pool worker dies: a model whose load kills its pool worker
(SIGKILL, as the OOM killer would) is a failed load. Its waiting request gets a 503 naming the cause and the
model backs off, instead of being loaded again and again on each restarted worker while its requests wait
(with no deadline: for good); the pool's other models are served meanwhile."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.conftest import start_server
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
