"""Pools through a real `inferd serve`: `[pools.p] workers = 2`, each worker with room for two of five sim
models (memory_mb, load_ms). Requests to all five: every answer is its own, the models are loaded on
demand and evicted to make room, and /metrics, /admin/pools and `inferd status` say so. Then the
start-time refusals: a model over its pool's budget, an unknown pool, `pool` on an LLM model."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import aiohttp
import pytest
from typer.testing import CliRunner

from inferd.cli.main import app as cli_app
from inferd.models.sim import sim_digest
from tests.conftest import ServerProc, start_server

MODELS = "abcde"
POOLED = """builtin = "sim"
pool = "p"
memory_mb = 60
max_wait_ms = 2

[params]
base_ms = 5.0
memory_mb = 50
load_ms = 150
"""
BROKEN = """implementation = "model.py:Model"
pool = "p"
memory_mb = 10

[[inputs]]
name = "INPUT0"
datatype = "BYTES"

[[outputs]]
name = "OUTPUT0"
datatype = "BYTES"
"""
BROKEN_PY = """from inferd.models import base


class Model(base.Model):
    def load(self) -> None:
        raise RuntimeError("no weights in this folder")

    def predict_batch(self, inputs):
        raise AssertionError("never loaded")
"""
POOLS = """[pools.p]
workers = 2
memory_budget_mb = 130
min_resident_s = 0.2
"""


def write(root: Path, models: dict[str, str], config: str = POOLS) -> tuple[Path, Path]:
    repo = root / "repo"
    for name, toml in models.items():
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    path = root / "inferd.toml"
    path.write_text(config)
    return repo, path


@pytest.fixture
def pooled(tmp_path: Path) -> Iterator[ServerProc]:
    repo, config = write(tmp_path, {**{m: POOLED for m in MODELS}, "broken": BROKEN})
    (repo / "broken" / "1").mkdir()
    (repo / "broken" / "1" / "model.py").write_text(BROKEN_PY)
    (repo / "a" / "1").mkdir()  # a version folder: version 2 comes later (a rolling update)
    server = start_server(tmp_path, "--model-repo", str(repo), "--config", str(config), "--no-grpc")
    yield server
    assert server.stop() in (0, -15)


def body(text: str) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}


async def infer(http: aiohttp.ClientSession, server: ServerProc, model: str, text: str, version: int = 1) -> None:
    async with http.post(f"{server.url}/v2/models/{model}/infer", json=body(text)) as r:
        answer = await r.json()
        assert r.status == 200, answer
    assert answer["model_name"] == model and answer["model_version"] == str(version)
    assert answer["outputs"][0]["data"] == [sim_digest(model, version, text)]  # its own answer


def samples(text: str, name: str) -> dict[str, float]:
    """`name`'s samples by their label text: {'{model="a"}': 2.0, ...}."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            found[labels] = float(value)
    return found


async def settled_metrics(http: aiohttp.ClientSession, server: ServerProc) -> str:
    """/metrics once every model's load is counted (the counts come with the pool workers' next
    PoolState, on another connection than the answers): at most 5 s."""
    async with asyncio.timeout(5.0):
        while True:
            async with http.get(f"{server.url}/metrics") as r:
                text = await r.text()
            if len(samples(text, "inferd_model_loads_total")) == len(MODELS):
                return text
            await asyncio.sleep(0.1)


async def test_a_pool_serves_every_model_on_demand_and_evicts_to_make_room(pooled: ServerProc) -> None:
    server = pooled
    async with aiohttp.ClientSession() as http:
        for round_ in range(3):  # each round: every model at once, several requests each
            await asyncio.gather(
                *(infer(http, server, m, f"{m}-{round_}-{i}") for m in MODELS for i in range(4))
            )
        metrics = await settled_metrics(http, server)
        async with http.get(f"{server.admin_url}/admin/pools") as r:
            pools = (await r.json())["pools"]
        await drain_one_model_server(http, server)
        async with http.get(f"{server.url}/v2/health/ready") as r:
            assert r.status == 200
        for _ in range(2):  # a load that fails: 503 naming the cause, then its backoff's, never a loop
            async with http.post(f"{server.url}/v2/models/broken/infer", json=body("x")) as r:
                assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
                assert "no weights in this folder" in (await r.json())["error"]
        async with http.get(f"{server.url}/metrics") as r:
            assert 'inferd_model_loads_total{model="broken"}' not in await r.text()
    loads = samples(metrics, "inferd_model_loads_total")
    assert set(loads) == {f'{{model="{m}"}}' for m in MODELS}  # every model was loaded
    assert sum(samples(metrics, "inferd_model_evictions_total").values()) >= 1  # five models, room for four
    assert sum(loads.values()) >= len(MODELS) + 1
    assert set(samples(metrics, "inferd_model_load_seconds_count")) == set(loads)
    used = samples(metrics, "inferd_pool_memory_used_mb")
    budgets = samples(metrics, "inferd_pool_memory_budget_mb")
    assert len(used) == 2 and set(budgets.values()) == {130.0}
    assert all(0 < mb <= 130.0 for mb in used.values())
    assert samples(metrics, "inferd_cold_start_seconds_count")  # the pooled models' cold starts
    [pool] = pools
    assert pool["name"] == "p" and len(pool["workers"]) == 2
    held = [m for w in pool["workers"] for m in w["models"]]
    assert 1 <= len(held) <= 4 and all(m["state"] in ("loading", "ready", "unloading") for m in held)
    assert all(m["memory_mb"] >= 45.0 for m in held if m["state"] == "ready"), held  # sim's 50 MiB each
    await rolling_update(server, server.log_path.parent / "repo")
    table, page = status(server), status(server, "--json")
    assert "pools" in table and "pool:p-0" in table and "budget MiB" in table
    assert [p["name"] for p in json.loads(page)["pools"]["pools"]] == ["p"]


async def drain_one_model_server(http: aiohttp.ClientSession, server: ServerProc) -> None:
    """Each model a pool worker holds is a worker of its own, `<pool worker id>/<model>:<version>`, which
    the admin API finds and drains apart from the pool worker's other models."""
    await infer(http, server, "b", "held")
    async with http.get(f"{server.admin_url}/admin/workers") as r:
        rows = [w for w in (await r.json())["workers"] if w["model"] in MODELS]
    ids = [w["worker_id"] for w in rows]
    assert any(w["model"] == "b" for w in rows) and len(set(ids)) == len(ids), ids
    assert all(re.fullmatch(rf"pool:p-\d+\.\d+/{w['model']}:{w['version']}", w["worker_id"]) for w in rows), ids
    [b] = [w for w in rows if w["model"] == "b"][:1]
    async with http.post(f"{server.admin_url}/admin/workers/{quote(b['worker_id'], safe='')}/drain") as r:
        drained = await r.json()
        assert r.status == 200, drained
    assert drained == {"worker_id": b["worker_id"], "state": "draining"}


async def rolling_update(server: ServerProc, repo: Path) -> None:
    """A pooled model's update serves the new version at once (on demand) and its pool's workers
    unload the old one; scaling a pooled model is refused (its pool's workers serve it)."""
    shutil.copytree(repo / "a" / "1", repo / "a" / "2")
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.admin_url}/admin/models/a/update") as r:
            assert r.status == 200 and await r.json() == {"model": "a", "from": 1, "to": 2, "replaced": 0}
        await infer(http, server, "a", "after the update", version=2)
        async with http.post(f"{server.admin_url}/admin/models/a/scale?workers=2") as r:
            assert r.status == 400 and "served by pool 'p'" in (await r.json())["error"]
        async with asyncio.timeout(5.0):
            while True:  # the old version leaves the pool's workers
                async with http.get(f"{server.admin_url}/admin/pools") as r:
                    held = [(m["model"], m["version"]) for w in (await r.json())["pools"][0]["workers"] for m in w["models"]]
                if ("a", 1) not in held:
                    break
                await asyncio.sleep(0.1)


def status(server: ServerProc, *args: str) -> str:
    done = CliRunner().invoke(cli_app, ["status", "--admin-url", server.admin_url, *args], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    return done.stdout


@pytest.mark.parametrize(
    ("models", "named"),
    [
        ({"big": POOLED.replace("memory_mb = 60", "memory_mb = 500")},
         "memory_mb = 500 is above the memory_budget_mb = 130 of pool 'p'"),
        ({"lost": POOLED.replace('pool = "p"', 'pool = "q"')}, "pool = 'q' is not defined (pools defined: [pools.p])"),
        ({"chat": 'builtin = "sim-llm"\npool = "p"\n'}, "only batch models are loaded on a pool's workers"),
    ],
)
def test_a_model_that_does_not_fit_the_pools_is_refused_at_start(
    tmp_path: Path, models: dict[str, str], named: str
) -> None:
    repo, config = write(tmp_path, models)
    args = ["serve", "--port", "0", "--no-grpc", "--model-repo", str(repo), "--config", str(config)]
    done = CliRunner().invoke(cli_app, [*args, "--data-dir", str(tmp_path / "data")], env={"COLUMNS": "200"})
    assert done.exit_code == 2, done.output  # refused before anything started
    assert named in " ".join(done.output.split()), done.output  # the message may be wrapped



async def test_with_two_front_ends_each_pool_worker_is_counted_once(tmp_path: Path) -> None:
    """Every front end sees every pool worker; only the owner exports the pool families, so the whole
    server's /metrics (one `frontend` label per front end) counts each load once."""
    repo, config = write(tmp_path, {m: POOLED for m in "ab"})
    server = start_server(tmp_path, "--model-repo", str(repo), "--config", str(config), "--no-grpc",
                          "--frontends", "2")
    try:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(infer(http, server, m, f"{m}-{i}") for m in "ab" for i in range(6)))
            async with asyncio.timeout(5.0):
                while True:
                    async with http.get(f"{server.url}/metrics") as r:
                        loads = samples(await r.text(), "inferd_model_loads_total")
                    if len(loads) == 2:
                        break
                    await asyncio.sleep(0.1)
        assert set(loads) == {'{frontend="0",model="a"}', '{frontend="0",model="b"}'}
        assert all(1 <= n <= 2 for n in loads.values())  # two front ends may each ask a worker: 2 at most
    finally:
        assert server.stop() in (0, -15)
