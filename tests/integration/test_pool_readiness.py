"""The server's readiness beside a broken pooled model, through a real `inferd serve` (runtime/readiness.py).

A pool of one worker serves a healthy model and one whose load raises, beside a model kept warm. Throughout
the broken model's failed loads and backoffs the server's /v2/health/ready (polled all along) and gRPC
ServerReady stay ready, while that model's own ready route and ModelReady say not ready, the repository
index says UNAVAILABLE with the cause, and its requests get the 503 with Retry-After naming it; the other
models answer. A pool with no worker (its workers remote, none joined) holds its models down, not the
server, until one joins."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tritonclient.grpc as tc

from tests.conftest import ServerProc, free_port, start_server
from tests.integration.test_pool_failures import REMOTE_ONLY, ready, start_pool_worker
from tests.integration.test_pools import BROKEN, BROKEN_PY, POOLED, body, infer, write

ONE_WORKER = """[pools.p]
workers = 1
memory_budget_mb = 130
min_resident_s = 0.2
"""
WARM = 'builtin = "sim"\nmax_wait_ms = 1\n[params]\nbase_ms = 2.0\n'
CAUSE = "no weights in this folder"


class Probe:
    """Polls the server's /v2/health/ready until stopped, keeping every status it answered."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url = http, url
        self.statuses: list[int] = []

    async def run(self) -> None:
        while True:
            async with self.http.get(f"{self.url}/v2/health/ready") as r:
                self.statuses.append(r.status)
            await asyncio.sleep(0.05)


async def refused(http: aiohttp.ClientSession, server: ServerProc) -> tuple[str, int]:
    """A request to the broken model: its 503's error and Retry-After."""
    async with http.post(f"{server.url}/v2/models/broken/infer", json=body("x")) as r:
        answer = await r.json()
        assert r.status == 503, answer
        return answer["error"], int(r.headers["Retry-After"])


async def index_row(http: aiohttp.ClientSession, server: ServerProc, model: str) -> dict[str, Any]:
    async with http.post(f"{server.url}/v2/repository/index", json={}) as r:
        rows = await r.json()
        assert r.status == 200, rows
    [row] = [row for row in rows if row["name"] == model]
    return row


async def test_a_pooled_model_in_its_load_backoff_holds_itself_down_never_the_server(tmp_path: Path) -> None:
    repo, config = write(tmp_path, {"a": POOLED, "broken": BROKEN, "warm": WARM}, ONE_WORKER)
    (repo / "broken" / "1").mkdir()
    (repo / "broken" / "1" / "model.py").write_text(BROKEN_PY)
    server = start_server(tmp_path, "--model-repo", str(repo), "--config", str(config))
    client = tc.InferenceServerClient(server.grpc_target)
    try:
        async with aiohttp.ClientSession() as http:
            probe = Probe(http, server.url)
            probing = asyncio.create_task(probe.run())
            try:
                await infer(http, server, "a", "before")
                seen = await within_a_backoff(http, server, client)
                await asyncio.gather(infer(http, server, "a", "during"), infer(http, server, "warm", "during"))
            finally:
                probing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await probing
        assert len(probe.statuses) >= 2 and set(probe.statuses) == {200}, probe.statuses  # ready throughout
        assert seen["model_ready"] == 503 and seen["grpc"] == (True, False, True)
        assert seen["row"]["state"] == "UNAVAILABLE" and CAUSE in seen["row"]["reason"], seen["row"]
        assert "next try is in" in seen["row"]["reason"]
        error, retry_after = seen["refused"]
        assert CAUSE in error and "next try is in" in error and retry_after >= 1
    finally:
        client.close()
        assert server.stop() in (0, -15)


async def within_a_backoff(http: aiohttp.ClientSession, server: ServerProc, client: tc.InferenceServerClient) -> dict[str, Any]:
    """What the broken model's ready route, gRPC ServerReady/ModelReady and its index row say during its
    backoff. A round starts with a request that finds the backoff over (or none yet): its load fails (the
    backoff starts, and is longer each time), else the backoff still runs. What is read next is known to
    fall within that backoff when the round's last request is still refused by it ("the next try is in"):
    nothing between them could load the model again (a request is refused, never held, in a backoff). A
    machine too slow for a round gets the next, twice as long."""
    for _ in range(6):
        error, retry_after = await refused(http, server)
        assert CAUSE in error and retry_after >= 1  # the failed load, or its backoff: never held for good
        async with http.get(f"{server.url}/v2/models/broken/ready") as r:
            model_ready = r.status
        row = await index_row(http, server, "broken")
        grpc = await asyncio.to_thread(
            lambda: (client.is_server_ready(), client.is_model_ready("broken"), client.is_model_ready("a"))
        )
        last = await refused(http, server)
        if "next try is in" in last[0]:
            return {"model_ready": model_ready, "row": row, "grpc": grpc, "refused": last}
    raise AssertionError("no round of checks fell within one backoff")


async def test_a_pool_with_no_worker_holds_its_models_down_not_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`workers = 0`: the pool's workers are `inferd worker --pool` processes on other hosts. Until one
    joins, its models say why they are not ready; the server is ready from the start."""
    monkeypatch.setenv("INFERD_JOIN_TOKEN", "pool-secret")
    repo, config = write(tmp_path, {"a": POOLED}, REMOTE_ONLY)
    worker_port = free_port()
    args = ("--model-repo", str(repo), "--config", str(config), "--no-grpc", "--worker-port", str(worker_port))
    server = start_server(tmp_path, *args, ready_path="/v2/health/live")
    worker = None
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/v2/health/ready") as r:
                assert r.status == 200
            async with http.get(f"{server.url}/v2/models/a/ready") as r:
                assert r.status == 503
            row = await index_row(http, server, "a")
            assert row["state"] == "UNAVAILABLE" and "pool 'p' has no worker" in row["reason"], row
            async with http.post(f"{server.url}/v2/models/a/infer", json=body("x")) as r:
                answer = await r.json()
                assert r.status == 503 and "inferd worker --pool p" in answer["error"], answer
            worker = start_pool_worker(tmp_path, worker_port)
            await ready(http, server.url, "/v2/models/a/ready")  # a worker joined: served on demand
            assert (await index_row(http, server, "a"))["state"] == "READY"
            await infer(http, server, "a", "once one joined")
    finally:
        if worker is not None:
            worker.terminate()
            assert worker.wait(15) == 0
        assert server.stop() in (0, -15)
