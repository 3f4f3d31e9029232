"""Changing the fleet under load, with real processes: scale up and down (drain first), a rolling update
to a new model version, and a kill among 4 workers. No request may fail."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from inferd.models.sim import sim_digest
from tests.conftest import ServerProc, start_server

MODEL_TOML = """builtin = "sim"
workers = {workers}
max_batch_size = 50
max_wait_ms = 5
max_queue_size = 2000

[params]
base_ms = 30.0
per_item_ms = 0.2
"""


def make_repo(tmp_path: Path, workers: int) -> Path:
    repo = tmp_path / "repo"
    (repo / "sim" / "1").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text(MODEL_TOML.format(workers=workers))
    return repo


class Load:
    """Closed-loop callers that check every answer against the version that says it answered."""

    def __init__(self, url: str, callers: int = 16) -> None:
        self.url = f"{url}/v2/models/sim/infer"
        self.callers = callers
        self.failures: list[str] = []
        self.versions: list[str] = []
        self.ok = 0
        self._stop = asyncio.Event()

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(self._caller(http, n) for n in range(self.callers)))

    def stop(self) -> None:
        self._stop.set()

    async def _caller(self, http: aiohttp.ClientSession, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            text = f"c{n}-{i}"
            i += 1
            body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}
            async with http.post(self.url, json=body) as r:
                payload = await r.json()
                if r.status != 200:
                    self.failures.append(f"{r.status} {payload}")
                    continue
                version = payload["model_version"]
                if payload["outputs"][0]["data"] != [sim_digest("sim", int(version), text)]:
                    self.failures.append(f"wrong answer for {text} from v{version}")
                self.versions.append(version)
                self.ok += 1


async def admin(http: aiohttp.ClientSession, server: ServerProc, path: str, post: bool = False) -> dict:
    method = http.post if post else http.get
    async with method(f"{server.admin_url}{path}", timeout=aiohttp.ClientTimeout(total=120)) as r:
        body = await r.json()
        assert r.status == 200, body
        return body


async def ready_count(http: aiohttp.ClientSession, server: ServerProc) -> int:
    workers = (await admin(http, server, "/admin/workers"))["workers"]
    return sum(w["state"] == "ready" for w in workers)


async def until(predicate: Callable[[], Awaitable[bool] | bool], timeout_s: float = 60.0) -> None:
    """Poll another process's observable state (over HTTP, or the load's counters) until it holds."""
    async with asyncio.timeout(timeout_s):
        while True:
            value = predicate()
            if await value if inspect.isawaitable(value) else value:
                return
            await asyncio.sleep(0.05)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[ServerProc, Path]]:
    repo = make_repo(tmp_path, workers=2)
    s = start_server(tmp_path, "--model-repo", str(repo))
    yield s, repo
    assert s.stop() in (0, -15)


async def test_rolling_update_under_load_fails_no_request(fleet: tuple[ServerProc, Path]) -> None:
    server, repo = fleet
    load = Load(server.url)
    async with aiohttp.ClientSession() as http:
        runner = asyncio.ensure_future(load.run())
        await until(lambda: load.ok > 50)
        shutil.copytree(repo / "sim" / "1", repo / "sim" / "2")
        result = await admin(http, server, "/admin/models/sim/update", post=True)
        seen_after = len(load.versions)
        await until(lambda: len(load.versions) > seen_after + 100)
        load.stop()
        await runner
        workers = (await admin(http, server, "/admin/workers"))["workers"]
        fleet_row = (await admin(http, server, "/admin/models"))["models"]["sim"]["fleet"]
        async with http.get(f"{server.url}/v2/models/sim") as r:
            meta = await r.json()
    assert result == {"model": "sim", "from": 1, "to": 2, "replaced": 2}
    assert fleet_row == sorted(
        ({"worker_id": w["worker_id"], "zone": None, "version": 2, "state": "ready"} for w in workers),
        key=lambda r: r["worker_id"],
    )
    assert load.failures == []
    assert {"1", "2"} <= set(load.versions) and set(load.versions[-50:]) == {"2"}
    assert sorted(w["version"] for w in workers) == [2, 2]
    assert meta["versions"] == ["2"]


async def test_scale_up_then_down_drains_without_failures(fleet: tuple[ServerProc, Path]) -> None:
    server, _ = fleet
    load = Load(server.url)
    async with aiohttp.ClientSession() as http:
        runner = asyncio.ensure_future(load.run())
        assert (await admin(http, server, "/admin/models/sim/scale?workers=4", post=True))["workers"] == 4
        await until(lambda: _ready_is(http, server, 4))
        await admin(http, server, "/admin/models/sim/scale?workers=1", post=True)
        await until(lambda: _ready_is(http, server, 1))
        before = load.ok
        await until(lambda: load.ok > before + 50)
        load.stop()
        await runner
    assert load.failures == [] and load.ok > 100


async def _ready_is(http: aiohttp.ClientSession, server: ServerProc, n: int) -> bool:
    workers = (await admin(http, server, "/admin/workers"))["workers"]
    return len(workers) == n and all(w["state"] == "ready" for w in workers)


async def test_four_workers_one_killed_under_load_loses_nothing(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--model-repo", str(make_repo(tmp_path, workers=4)))
    try:
        load = Load(server.url, callers=24)
        async with aiohttp.ClientSession() as http:
            await until(lambda: _ready_is(http, server, 4))
            runner = asyncio.ensure_future(load.run())
            await until(lambda: load.ok > 100)
            victim = (await admin(http, server, "/admin/workers"))["workers"][0]
            os.kill(victim["pid"], signal.SIGKILL)
            before = load.ok
            await until(lambda: _ready_is(http, server, 4))
            await until(lambda: load.ok > before + 200)
            load.stop()
            await runner
        assert load.failures == []
    finally:
        server.stop()


AUTOSCALE_TOML = """builtin = "sim"
workers = 1
max_batch_size = 10
max_wait_ms = 5
max_queue_size = 500

[params]
base_ms = 100.0
per_item_ms = 2.0

[autoscale]
min_workers = 1
max_workers = 3
target_busy_ratio = 0.7
max_predicted_wait_s = 0.1
scale_up_cooldown_s = 1.0
scale_down_cooldown_s = 3.0
scale_down_stabilization_s = 2.0
"""


async def test_autoscaler_scales_up_under_load_and_drains_down_after(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "sim" / "1").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text(AUTOSCALE_TOML)
    server = start_server(tmp_path, "--model-repo", str(repo))
    try:
        load = Load(server.url, callers=40)
        async with aiohttp.ClientSession() as http:
            runner = asyncio.ensure_future(load.run())
            await until(lambda: _ready_at_least(http, server, 2), timeout_s=30)
            load.stop()
            await runner
            await until(lambda: _ready_is(http, server, 1), timeout_s=30)
            async with http.get(f"{server.admin_url}/admin/models") as r:
                changes = (await r.json())["models"]["sim"]["autoscaler"]["changes"]
        assert load.failures == [] and load.ok > 50
        assert "scaling up from 1" in server.log() and "scaling down" in server.log()
        assert changes[0]["from"] == 1 and changes[0]["to"] > 1, changes
        assert changes[-1]["to"] < changes[-1]["from"], "the last change drained the fleet down"
    finally:
        server.stop()


async def _ready_at_least(http: aiohttp.ClientSession, server: ServerProc, n: int) -> bool:
    return await ready_count(http, server) >= n


async def test_fleet_cli_scale_and_drain(fleet: tuple[ServerProc, Path]) -> None:
    server, _ = fleet

    async def cli(*args: str) -> dict:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "inferd.cli.main",
            *args,
            "--admin-url",
            server.admin_url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return json.loads(out)

    async with aiohttp.ClientSession() as http:
        assert (await cli("scale", "sim", "--workers", "3"))["workers"] == 3
        await until(lambda: _ready_is(http, server, 3))
        victim = (await admin(http, server, "/admin/workers"))["workers"][0]["worker_id"]
        assert (await cli("drain", victim))["state"] == "draining"
        await until(lambda: _ready_is(http, server, 3))  # replaced
        ids = {w["worker_id"] for w in (await admin(http, server, "/admin/workers"))["workers"]}
    assert victim not in ids
