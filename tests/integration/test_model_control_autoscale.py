"""A model loaded while the server runs (the repository API) scales as one served at start: its
`[autoscale]` table is read from its folder then, and its scaling loop (the waker of a `min_workers = 0`
model) is made afresh, so that its first request wakes a worker. Two cases on one real `inferd serve
--model-control explicit`: a model loaded after the start, and a model served at start that scaled up from
zero, then was unloaded and loaded again (its old loop's target was stale: it never woke again)."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from inferd.models.sim import sim_digest
from tests.conftest import ServerProc, start_server

ZERO = """builtin = "sim"
workers = 0
max_wait_ms = 2

[params]
base_ms = 5.0

[autoscale]
min_workers = 0
max_workers = 1
"""
TIMEOUT_US = 20_000_000
"""Each request's deadline: well past a worker's start (a request never woken waits for it, then 504)."""


async def post(http: aiohttp.ClientSession, server: ServerProc, path: str, body: dict) -> tuple[int, dict]:
    async with http.post(f"{server.url}{path}", json=body) as r:
        return r.status, await r.json()


async def first_answer(http: aiohttp.ClientSession, server: ServerProc, model: str, text: str) -> None:
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}], "parameters": {"timeout": TIMEOUT_US}}
    status, answer = await post(http, server, f"/v2/models/{model}/infer", body)
    assert status == 200, answer
    assert answer["outputs"][0]["data"] == [sim_digest(model, 1, text)]


async def control(http: aiohttp.ClientSession, server: ServerProc, model: str, op: str) -> None:
    status, answer = await post(http, server, f"/v2/repository/models/{model}/{op}", {})
    assert status == 200, answer


async def test_a_model_loaded_while_serving_scales_from_zero(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("early", "late"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "model.toml").write_text(ZERO)
    server = start_server(tmp_path, "--model-repo", str(repo), "--model-control", "explicit", "--load-model", "early")
    try:
        async with aiohttp.ClientSession() as http:
            await first_answer(http, server, "early", "a")  # scaled up from zero: one worker
            await control(http, server, "early", "unload")  # its worker drained and stopped
            await control(http, server, "early", "load")  # served again with no worker
            await first_answer(http, server, "early", "b")  # woken again
            await control(http, server, "late", "load")  # not served at start
            await first_answer(http, server, "late", "c")
    finally:
        server.stop()

