"""Scale from zero with a real `inferd serve`: a sim model at `[autoscale] min_workers = 0` starts with no
worker, is ready on demand, and answers its first request once the scaling loop has started a worker
(the request waits in the cold queue meanwhile); the cold start is in `inferd_cold_start_seconds`. Idle,
it scales back to zero; then a request whose deadline is nearer than the measured start gets a 429 at
once, and a burst past the cold bound gets 429s with Retry-After for the excess, 200s for the rest, and
never a 5xx. With `--frontends 2`, a follower (which runs no autoscaler) holds its requests too, instead of a
503, until the worker the owner's scaling loop starts joins it.

Bounded: one server at a time, one worker at most, bursts of 16 requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from inferd.models.sim import sim_digest
from tests.checked_load import wait_for
from tests.conftest import ServerProc, start_server
from tests.integration.test_fleet import admin, ready_count, until

MODEL_TOML = """builtin = "sim"
workers = 0
max_batch_size = 4
max_wait_ms = 2
cold_queue_size = 6

[params]
base_ms = 20.0
per_item_ms = 1.0
load_ms = 300.0

[autoscale]
min_workers = 0
max_workers = 1
scale_up_cooldown_s = 0.5
scale_down_cooldown_s = 0.5
scale_down_stabilization_s = 1.0
"""
BURST = 16


def body(text: str, timeout_us: int | None = None) -> dict:
    params = {} if timeout_us is None else {"parameters": {"timeout": timeout_us}}
    return {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}], **params}


async def infer(http: aiohttp.ClientSession, server: ServerProc, text: str, timeout_us: int | None = None) -> tuple[int, dict, str | None]:
    async with http.post(f"{server.url}/v2/models/sim/infer", json=body(text, timeout_us)) as r:
        return r.status, await r.json(), r.headers.get("Retry-After")


async def cold_starts(
    http: aiohttp.ClientSession, server: ServerProc, frontend: str = "", model: str = "sim"
) -> tuple[float, float]:
    """The count and sum of the model's scale-from-zero cold starts (of one front end: `frontend`)."""
    async with http.get(f"{server.url}/metrics") as r:
        text = await r.text()
    found = {}
    for line in text.splitlines():
        if line.startswith("inferd_cold_start_seconds_") and f'model="{model}"' in line and 'cause="scale_from_zero"' in line:
            if frontend and f'frontend="{frontend}"' not in line:
                continue
            name, _, value = line.rpartition(" ")
            found[name.split("{")[0]] = float(value)
    return found.get("inferd_cold_start_seconds_count", 0.0), found.get("inferd_cold_start_seconds_sum", 0.0)


async def test_a_model_at_zero_workers_answers_its_first_request_and_bounds_a_burst(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "sim" / "1").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text(MODEL_TOML)
    server = start_server(tmp_path, "--model-repo", str(repo))  # ready with no worker: served on demand
    try:
        async with aiohttp.ClientSession() as http:
            assert await ready_count(http, server) == 0
            async with http.get(f"{server.url}/v2/models/sim/ready") as r:
                assert r.status == 200
            status, answer, _ = await infer(http, server, "first")
            assert status == 200, answer
            assert answer["outputs"][0]["data"] == [sim_digest("sim", 1, "first")]
            count, seconds = await cold_starts(http, server)
            assert count == 1.0 and seconds > 0.0
            changes = (await admin(http, server, "/admin/models"))["models"]["sim"]["autoscaler"]["changes"]
            assert (changes[0]["from"], changes[0]["to"]) == (0, 1) and "from zero" in changes[0]["reason"]

            await until(lambda: no_worker(http, server), timeout_s=20)  # idle: back to zero
            status, answer, retry = await infer(http, server, "late", timeout_us=1_000)  # 1 ms: past the start
            assert status == 429 and retry is not None and int(retry) >= 1, answer
            assert "to start" in answer["error"]
            assert await ready_count(http, server) == 0  # refused at once: nothing woke

            results = await asyncio.gather(*(infer(http, server, f"b{i}") for i in range(BURST)))
        statuses = [s for s, _, _ in results]
        assert all(s in (200, 429) for s in statuses), results
        assert statuses.count(200) >= 6 and statuses.count(429) >= 1, statuses
        for i, (s, answer, retry) in enumerate(results):
            if s == 200:
                assert answer["outputs"][0]["data"] == [sim_digest("sim", 1, f"b{i}")]
            else:
                assert retry is not None and int(retry) >= 1 and "cold queue is full" in answer["error"]
        assert "Traceback" not in server.log()
    finally:
        server.stop()


def listeners(port: int) -> int:
    """Sockets listening on the TCP port (each front end of `--frontends N` binds its own: SO_REUSEPORT)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(1 for r in rows if r[3] == "0A" and int(r[1].rpartition(":")[2], 16) == port)


async def test_a_follower_holds_its_requests_for_the_owners_scaling_loop(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "sim" / "1").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text(MODEL_TOML.replace("cold_queue_size = 6", "cold_queue_size = 32"))
    server = start_server(tmp_path, "--model-repo", str(repo), "--frontends", "2")
    try:  # both front ends take connections (the first one ready answered start_server), the owner's admin API
        wait_for(lambda: listeners(server.port) == 2 and listeners(server.admin_port) == 1, 20, "both listening")
        connector = aiohttp.TCPConnector(force_close=True)  # a connection per request: both front ends get some
        async with aiohttp.ClientSession(connector=connector) as http:
            assert await ready_count(http, server) == 0
            results = await asyncio.gather(*(infer(http, server, f"f{i}") for i in range(BURST)))
            assert [s for s, _, _ in results] == [200] * BURST, results
            for i, (_, answer, _) in enumerate(results):
                assert answer["outputs"][0]["data"] == [sim_digest("sim", 1, f"f{i}")]
            assert (await cold_starts(http, server, frontend="1"))[0] == 1.0  # the follower held some
    finally:
        server.stop()


async def no_worker(http: aiohttp.ClientSession, server: ServerProc) -> bool:
    workers = (await admin(http, server, "/admin/workers"))["workers"]
    return not workers
