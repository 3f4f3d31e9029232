"""SIGTERM under load: everything accepted is answered, then the server and its workers exit."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp

from inferd.models.sim import sim_digest
from tests.conftest import ROOT, alive, start_server


async def test_sigterm_drains_in_flight_requests_and_leaves_no_orphans(tmp_path: Path) -> None:
    server = start_server(
        tmp_path, "--model-repo", str(ROOT / "tests" / "data" / "faulty_repo"), "--model", "sim"
    )
    workers = server.worker_pids()
    assert workers, "the server should have started a worker process"
    url = f"{server.url}/v2/models/sim/infer"
    async with aiohttp.ClientSession() as http:

        async def call(i: int) -> tuple[int, dict]:
            body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [f"s{i}"]}]}
            async with http.post(url, json=body) as r:
                return r.status, await r.json()

        calls = [asyncio.ensure_future(call(i)) for i in range(30)]  # 3 batches of 10 at 200 ms each
        # wait until every request is accepted: the queue plus running batches hold all 30
        for _ in range(200):
            async with http.get(f"{server.url}/metrics") as r:
                text = await r.text()
            queued = float(text.split('inferd_queue_depth{model="sim",version="1"} ')[1].split()[0])
            inflight = float(text.split('inferd_inflight_batches{model="sim",version="1"} ')[1].split()[0])
            if queued + 10 * inflight >= 30:
                break
            await asyncio.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*calls)
    assert [s for s, _ in results] == [200] * 30
    for i, (_, body) in enumerate(results):
        assert body["outputs"][0]["data"] == [sim_digest("sim", 1, f"s{i}")]
    assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert not [p for p in workers if alive(p)], "worker processes outlived the server"
