"""A pool under `inferd serve --frontends 2`: a load queued on a pool worker (behind its
max_concurrent_loads) is seen by both front ends, so the first requests of its model on either front end
wait for it, and the model is loaded once.

The pool: 2 workers with room for 130 MiB each, one load at a time. "filler" (80 MiB) is loaded first,
on worker X; "slow" (40 MiB, a 3 s load) then goes to the roomier worker Y; "m" (40 MiB) too (50 MiB
free on X, 90 on Y), where it waits behind "slow". Then "filler" is unloaded: X is now the roomier, and a
front end that did not know "m" was queued on Y would ask X for a copy of its own. Requests for "m" on
new connections (both front ends get some) must all be answered by the one copy loaded on Y.

And a hot model still gets one more holder, now that only the holder of the `decider` lease spreads.

Bounded: one server at a time, two pool workers, at most 121 requests; about 14 s in all."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from inferd.models.sim import sim_digest
from tests.checked_load import wait_for
from tests.conftest import ServerProc, start_server
from tests.integration.test_fleet import admin, until
from tests.integration.test_pools import samples, write
from tests.integration.test_scale_from_zero import listeners

POOLED = """builtin = "sim"
pool = "p"
memory_mb = {mb}
max_wait_ms = 2

[params]
base_ms = 2.0
memory_mb = {mb}
load_ms = {load_ms}
"""
POOLS = """[pools.p]
workers = 2
memory_budget_mb = 130
max_concurrent_loads = 1
min_resident_s = 0.2
"""


def body(text: str) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}


async def infer(http: aiohttp.ClientSession, server: ServerProc, model: str, text: str) -> None:
    async with http.post(f"{server.url}/v2/models/{model}/infer", json=body(text)) as r:
        answer = await r.json()
        assert r.status == 200, answer
    assert answer["outputs"][0]["data"] == [sim_digest(model, 1, text)]  # its own answer


async def workers(http: aiohttp.ClientSession, server: ServerProc) -> list[dict[str, Any]]:
    return (await admin(http, server, "/admin/pools"))["pools"][0]["workers"]


def holding(found: list[dict[str, Any]], model: str, state: str = "ready") -> list[str]:
    return [w["worker_id"] for w in found if any(m["model"] == model and m["state"] == state for m in w["models"])]


async def test_a_load_queued_by_one_front_end_is_joined_by_the_other(tmp_path: Path) -> None:
    models = {
        "filler": POOLED.format(mb=80, load_ms=50),
        "slow": POOLED.format(mb=40, load_ms=3000),
        "m": POOLED.format(mb=40, load_ms=50),
    }
    repo, config = write(tmp_path, models, POOLS)
    server = start_server(tmp_path, "--model-repo", str(repo), "--config", str(config), "--frontends", "2", "--no-grpc")
    try:  # both front ends take connections (the first one ready answered start_server), the owner's admin API
        wait_for(lambda: listeners(server.port) == 2 and listeners(server.admin_port) == 1, 20, "both listening")
        connector = aiohttp.TCPConnector(force_close=True)  # a connection per request: both front ends get some
        async with aiohttp.ClientSession(connector=connector) as http:
            await until(lambda: _count(http, server, 2), 20)  # both pool workers joined
            await infer(http, server, "filler", "f")
            await until(lambda: _held(http, server, "filler"), 10)
            [x] = holding(await workers(http, server), "filler")
            await asyncio.sleep(0.2)  # its PoolState reached the other front end too
            slow = asyncio.create_task(infer(http, server, "slow", "s"))
            await until(lambda: _held(http, server, "slow", "loading"), 10)
            first = asyncio.create_task(infer(http, server, "m", "m-first"))
            await until(lambda: _queued(http, server), 10)  # "m" waits behind "slow" on Y
            found = await workers(http, server)
            [y] = holding(found, "slow", "loading")
            assert x != y and [w["waiting_loads"] for w in found if w["worker_id"] == y] == [1]
            async with http.post(f"{server.url}/v2/repository/models/filler/unload") as r:
                assert r.status == 200, await r.text()
            await until(lambda: _held(http, server, "filler", "none"), 10)  # X is empty: the roomier now
            await asyncio.gather(*(infer(http, server, "m", f"m{i}") for i in range(12)), first, slow)
            await until(lambda: _held(http, server, "m"), 10)  # its PoolState after the load
            found = await workers(http, server)
            assert holding(found, "m") == [y] and not holding(found, "m", "loading"), found  # one copy
            await until(lambda: _loaded(http, server, "m"), 10)
            assert await _loads(http, server, "m") == 1.0
        assert "Traceback" not in server.log()
    finally:
        assert server.stop() in (0, -15)


async def _count(http: aiohttp.ClientSession, server: ServerProc, n: int) -> bool:
    return len(await workers(http, server)) == n


async def _held(http: aiohttp.ClientSession, server: ServerProc, model: str, state: str = "ready") -> bool:
    found = await workers(http, server)
    if state == "none":
        return not any(m["model"] == model for w in found for m in w["models"])
    return bool(holding(found, model, state))


async def _queued(http: aiohttp.ClientSession, server: ServerProc) -> bool:
    return any(w["waiting_loads"] == 1 for w in await workers(http, server))


async def _loads(http: aiohttp.ClientSession, server: ServerProc, model: str) -> float:
    """inferd_model_loads_total of the model (the owner exports it: each pool worker counted once)."""
    async with http.get(f"{server.url}/metrics") as r:
        found = samples(await r.text(), "inferd_model_loads_total")
    return sum(v for labels, v in found.items() if f'model="{model}"' in labels)


async def _loaded(http: aiohttp.ClientSession, server: ServerProc, model: str) -> bool:
    return await _loads(http, server, model) > 0


HOT_POOLS = """[pools.p]
workers = 2
memory_budget_mb = 130
"""


async def test_a_hot_model_gets_one_more_holder_from_the_front_end_that_spreads(tmp_path: Path) -> None:
    """Only the holder of the `decider` lease spreads: it still does, counting the other front end's
    queue. 120 requests (30 batches of 100 ms for one holder) on new connections, both front ends: the
    model ends on both pool workers, every answer its own."""
    hot = POOLED.format(mb=40, load_ms=50).replace("base_ms = 2.0", "base_ms = 100.0")
    hot = hot.replace("max_wait_ms = 2", "max_wait_ms = 2\nmax_batch_size = 4\nmax_queue_size = 256")
    repo, config = write(tmp_path, {"hot": hot}, HOT_POOLS)
    server = start_server(tmp_path, "--model-repo", str(repo), "--config", str(config), "--frontends", "2", "--no-grpc")
    try:
        wait_for(lambda: listeners(server.port) == 2 and listeners(server.admin_port) == 1, 20, "both listening")
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:
            await until(lambda: _count(http, server, 2), 20)
            await infer(http, server, "hot", "first")
            await asyncio.gather(*(infer(http, server, "hot", f"h{i}") for i in range(120)))
            await until(lambda: _holders(http, server, "hot", 2), 10)
        assert "one more holder" in server.log()
    finally:
        assert server.stop() in (0, -15)


async def _holders(http: aiohttp.ClientSession, server: ServerProc, model: str, n: int) -> bool:
    return len(holding(await workers(http, server), model)) == n
