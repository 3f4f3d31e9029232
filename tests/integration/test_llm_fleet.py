"""Fleet operations on an LLM model through the real server and sim-llm worker processes: drain a worker,
scale up and down, roll to another version, and autoscale on the engines' pressure. Streams running
across every change complete with exactly their documented tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from inferd.kinds.llm.sim_llm import sim_llm_tokens
from tests.conftest import ServerProc, start_server
from tests.integration.test_fleet import admin, until

LLM_TOML = 'builtin = "sim-llm"\nworkers = {workers}\n[params]\nstep_base_ms = 10.0\n'


class Streams:
    """Closed-loop callers of /v1/completions that check every answer's tokens."""

    def __init__(self, url: str, model: str, callers: int, max_tokens: int = 40) -> None:
        self.url = f"{url}/v1/completions"
        self.model = model
        self.callers = callers
        self.max_tokens = max_tokens
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
            prompt = f"caller {n} request {i}"
            i += 1
            body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "seed": 3}
            async with http.post(self.url, json=body) as r:
                payload = await r.json()
                if r.status != 200:
                    self.failures.append(f"{r.status} {payload}")
                    continue
                want = " ".join(sim_llm_tokens(prompt, 3, self.max_tokens))
                if payload["choices"][0]["text"] != want:
                    self.failures.append(f"wrong tokens for {prompt!r}")
                self.versions.append(r.headers.get("X-Inferd-Model-Version", "?"))
                self.ok += 1


async def workers_of(http: aiohttp.ClientSession, server: ServerProc, model: str) -> list[dict]:
    rows = (await admin(http, server, "/admin/workers"))["workers"]
    return [w for w in rows if w["model"] == model]


async def ready_of(http: aiohttp.ClientSession, server: ServerProc, model: str) -> int:
    return sum(w["state"] == "ready" for w in await workers_of(http, server, model))


def make_repo(tmp_path: Path, toml: str, versions: tuple[int, ...] = (1,)) -> Path:
    repo = tmp_path / "repo"
    (repo / "sim-llm").mkdir(parents=True)
    for v in versions:
        (repo / "sim-llm" / str(v)).mkdir()
    (repo / "sim-llm" / "model.toml").write_text(toml)
    return repo


@pytest.fixture
def llm_fleet(tmp_path: Path) -> Iterator[tuple[ServerProc, Path]]:
    repo = make_repo(tmp_path, LLM_TOML.format(workers=2))
    s = start_server(tmp_path, "--model-repo", str(repo))
    yield s, repo
    assert s.stop() in (0, -15)


async def test_drain_scale_and_update_of_an_llm_model_fail_no_stream(
    llm_fleet: tuple[ServerProc, Path],
) -> None:
    server, repo = llm_fleet
    load = Streams(server.url, "sim-llm", callers=6)
    async with aiohttp.ClientSession() as http:
        runner = asyncio.ensure_future(load.run())
        await until(lambda: load.ok > 10)
        first = (await workers_of(http, server, "sim-llm"))[0]["worker_id"]
        drained = await admin(http, server, f"/admin/workers/{first}/drain", post=True)
        assert drained["state"] == "draining"
        await until(lambda: _replaced(http, server, first))
        assert (await admin(http, server, "/admin/models/sim-llm/scale?workers=3", post=True))["workers"] == 3
        await until(lambda: _ready_is(http, server, 3))
        await admin(http, server, "/admin/models/sim-llm/scale?workers=1", post=True)
        await until(lambda: _ready_is(http, server, 1))
        (repo / "sim-llm" / "2").mkdir()
        result = await admin(http, server, "/admin/models/sim-llm/update", post=True)
        seen = len(load.versions)
        await until(lambda: len(load.versions) > seen + 20)
        load.stop()
        await runner
        models = (await admin(http, server, "/admin/models"))["llm_models"]
    assert result == {"model": "sim-llm", "from": 1, "to": 2, "replaced": 1}
    assert load.failures == []
    assert set(load.versions[-10:]) == {"2"}
    assert models["sim-llm"]["version"] == 2 and models["sim-llm"]["workers"] == 1


async def _replaced(http: aiohttp.ClientSession, server: ServerProc, worker_id: str) -> bool:
    rows = await workers_of(http, server, "sim-llm")
    return worker_id not in {w["worker_id"] for w in rows} and sum(w["state"] == "ready" for w in rows) == 2


async def _ready_is(http: aiohttp.ClientSession, server: ServerProc, n: int) -> bool:
    rows = await workers_of(http, server, "sim-llm")
    return len(rows) == n and all(w["state"] == "ready" for w in rows)


AUTOSCALED = """builtin = "sim-llm"
workers = 1
[params]
step_base_ms = 10.0
[params.scheduler]
max_num_seqs = 2
[autoscale]
min_workers = 1
max_workers = 2
scale_up_cooldown_s = 0.0
scale_down_cooldown_s = 1.0
scale_down_stabilization_s = 2.0
max_waiting_per_worker = 1.0
target_ttft_s = 60.0
"""


async def test_an_llm_model_autoscales_up_under_waiting_sequences_and_back_down(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--model-repo", str(make_repo(tmp_path, AUTOSCALED)))
    try:
        load = Streams(server.url, "sim-llm", callers=8, max_tokens=60)
        async with aiohttp.ClientSession() as http:
            runner = asyncio.ensure_future(load.run())
            await until(lambda: _ready_count_is(http, server, 2), timeout_s=60)
            load.stop()
            await runner
            await until(lambda: _ready_count_is(http, server, 1), timeout_s=60)
            report = (await admin(http, server, "/admin/models"))["llm_models"]["sim-llm"]["autoscaler"]
    finally:
        assert server.stop() in (0, -15)
    assert load.failures == [] and load.ok > 0
    moves = [(c["from"], c["to"]) for c in report["changes"]]
    assert (1, 2) in moves and (2, 1) in moves
    up = next(c for c in report["changes"] if (c["from"], c["to"]) == (1, 2))
    assert "waiting" in up["reason"]


async def _ready_count_is(http: aiohttp.ClientSession, server: ServerProc, n: int) -> bool:
    return await ready_of(http, server, "sim-llm") == n
