"""Workers that fail, with real processes and real signals: crash mid-batch, hang, poison input,
non-idempotent models and crash loops. Every caller gets exactly one answer, and never another's."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Iterator

import aiohttp
import pytest

from inferd.models.sim import sim_digest
from tests.conftest import ROOT, ServerProc, alive, start_server

REPO = ROOT / "tests" / "data" / "chaos_repo"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(
        tmp_path_factory.mktemp("chaos"), "--model-repo", str(REPO), "--model", "sim", "--model", "fragile"
    )
    yield s
    assert s.stop() in (0, -15)


def body(text: str, rid: str) -> dict:
    return {"id": rid, "inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}


async def workers(http: aiohttp.ClientSession, server: ServerProc, model: str) -> list[dict]:
    async with http.get(f"{server.admin_url}/admin/workers") as r:
        return [w for w in (await r.json())["workers"] if w["model"] == model]


async def busy_worker(http: aiohttp.ClientSession, server: ServerProc, model: str) -> dict:
    """The worker running a batch, once the dispatcher has sent one (polls the admin API)."""
    for _ in range(400):
        running = [w for w in await workers(http, server, model) if w["inflight_batches"] > 0]
        if running:
            return running[0]
        await asyncio.sleep(0.01)
    raise AssertionError("no worker started a batch")


async def all_ready(http: aiohttp.ClientSession, server: ServerProc, model: str, n: int) -> None:
    for _ in range(600):
        if sum(w["state"] == "ready" for w in await workers(http, server, model)) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"model {model} did not get back to {n} ready workers")


async def fire(http: aiohttp.ClientSession, server: ServerProc, model: str, texts: list[str]) -> list:
    async def one(i: int, text: str) -> tuple[int, dict, dict]:
        async with http.post(f"{server.url}/v2/models/{model}/infer", json=body(text, f"r{i}")) as r:
            return r.status, await r.json(), {k.lower(): v for k, v in r.headers.items()}

    return [asyncio.ensure_future(one(i, t)) for i, t in enumerate(texts)]


async def test_sigkill_mid_batch_of_100_answers_everyone_once(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        await all_ready(http, server, "sim", 2)
        texts = [f"kill-{i}" for i in range(100)]
        calls = await fire(http, server, "sim", texts)
        victim = await busy_worker(http, server, "sim")
        os.kill(victim["pid"], signal.SIGKILL)
        results = await asyncio.gather(*calls)
        await all_ready(http, server, "sim", 2)  # replaced
    assert len(results) == 100
    retried = 0
    for i, (status, payload, headers) in enumerate(results):
        assert status == 200, payload
        assert payload["id"] == f"r{i}"
        assert payload["outputs"][0]["data"] == [sim_digest("sim", 1, texts[i])]
        retried += int(headers["x-inferd-attempts"]) > 1
    assert retried >= 1, "the killed batch's requests should show a second attempt"


async def test_sigstop_hang_times_out_and_worker_is_replaced(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        await all_ready(http, server, "sim", 2)
        texts = [f"hang-{i}" for i in range(30)]
        calls = await fire(http, server, "sim", texts)
        victim = await busy_worker(http, server, "sim")
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            results = await asyncio.gather(*calls)
        finally:
            if alive(victim["pid"]):
                os.kill(victim["pid"], signal.SIGCONT)
        await all_ready(http, server, "sim", 2)
        listed = {w["pid"] for w in await workers(http, server, "sim")}
    assert all(s == 200 for s, _, _ in results), [p for s, p, _ in results if s != 200][:3]
    for i, (_, payload, _) in enumerate(results):
        assert payload["outputs"][0]["data"] == [sim_digest("sim", 1, texts[i])]
    assert victim["pid"] not in listed and not alive(victim["pid"]), "the hung worker must be killed"


async def test_poison_input_in_batch_of_100_fails_alone(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        await all_ready(http, server, "sim", 2)
        texts = [f"ok-{i}" for i in range(100)]
        texts[37] = "!crash me"
        results = await asyncio.gather(*await fire(http, server, "sim", texts))
        await all_ready(http, server, "sim", 2)
    failed = [(i, s, p) for i, (s, p, _) in enumerate(results) if s != 200]
    assert [i for i, _, _ in failed] == [37], failed[:3]
    assert failed[0][1] == 422 and "crashed model 'sim'" in failed[0][2]["error"]
    for i, (_status, payload, _) in enumerate(results):
        if i != 37:
            assert payload["outputs"][0]["data"] == [sim_digest("sim", 1, texts[i])]


async def test_model_exception_is_isolated_to_its_input(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        await all_ready(http, server, "sim", 2)
        texts = [f"fine-{i}" for i in range(40)]
        texts[5] = "!fail here"
        results = await asyncio.gather(*await fire(http, server, "sim", texts))
    assert [i for i, (s, _, _) in enumerate(results) if s != 200] == [5]
    assert results[5][0] == 422 and "simulated failure" in results[5][1]["error"]


async def test_non_idempotent_model_is_never_retried(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        await all_ready(http, server, "fragile", 1)
        calls = await fire(http, server, "fragile", [f"f{i}" for i in range(20)])
        victim = await busy_worker(http, server, "fragile")
        os.kill(victim["pid"], signal.SIGKILL)
        results = await asyncio.gather(*calls)
    statuses = {s for s, _, _ in results}
    assert 503 in statuses and statuses <= {200, 503}
    for status, payload, headers in results:
        if status == 503:
            assert "not idempotent" in payload["error"]
        else:
            assert headers["x-inferd-attempts"] == "1"


async def test_admin_drain_replaces_a_worker_without_failing_requests(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        await all_ready(http, server, "sim", 2)
        calls = await fire(http, server, "sim", [f"d{i}" for i in range(60)])
        victim = await busy_worker(http, server, "sim")
        async with http.post(f"{server.admin_url}/admin/workers/{victim['worker_id']}/drain") as r:
            assert r.status == 200 and (await r.json())["state"] == "draining"
        results = await asyncio.gather(*calls)
        await all_ready(http, server, "sim", 2)
        ids = {w["worker_id"] for w in await workers(http, server, "sim")}
    assert all(s == 200 for s, _, _ in results)
    assert victim["worker_id"] not in ids


async def test_crash_loop_backs_off_and_answers_fast_503(tmp_path) -> None:
    s = start_server(
        tmp_path,
        "--model-repo",
        str(REPO),
        "--model",
        "sim",
        "--model",
        "broken_load",
        ready_path="/v2/models/sim/ready",
    )
    try:
        async with aiohttp.ClientSession() as http:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            async with http.post(f"{s.url}/v2/models/broken_load/infer", json=body("x", "1")) as r:
                assert r.status == 503 and "no ready worker" in (await r.json())["error"]
                assert r.headers["Retry-After"]
            assert loop.time() - t0 < 0.5
            async with http.get(f"{s.url}/v2/health/ready") as r:
                assert r.status == 503  # not every model is ready
            async with http.get(f"{s.url}/v2/models/sim/ready") as r:
                assert r.status == 200  # the other model is unaffected
            # let the crash loop run until three restarts (however slow this machine starts a worker):
            # the delays must grow, not storm
            for _ in range(600):
                if len(restart_delays(s)) >= 3:
                    break
                await asyncio.sleep(0.05)
    finally:
        s.stop()
    delays = restart_delays(s)
    assert len(delays) >= 3, delays
    assert delays == sorted(delays) and delays[2] >= 4 * delays[0], delays


def restart_delays(s: ServerProc) -> list[float]:
    return [float(x) for x in re.findall(r"worker broken_load-0 .*restarting in ([0-9.]+)s", s.log())]


async def test_backoff_resets_after_healthy_work(server: ServerProc) -> None:
    """A worker killed again and again, but each time after it completed a batch, is replaced at the
    initial backoff every time: repeated kills are recovered from, unlike a crash loop."""
    async with aiohttp.ClientSession() as http:
        for round_ in range(4):
            await all_ready(http, server, "fragile", 1)
            (worker,) = await workers(http, server, "fragile")
            for _ in range(200):  # each incarnation completes work before it is killed
                async with http.post(
                    f"{server.url}/v2/models/fragile/infer", json=body(f"b{round_}", "b")
                ) as r:
                    assert r.status == 200
                if (await workers(http, server, "fragile"))[0]["completed_batches"] >= 1:
                    break
            os.kill(worker["pid"], signal.SIGKILL)
            for _ in range(500):  # until the front end has seen it go
                if worker["pid"] not in {w["pid"] for w in await workers(http, server, "fragile")}:
                    break
                await asyncio.sleep(0.01)
        await all_ready(http, server, "fragile", 1)
    delays = [float(x) for x in re.findall(r"worker fragile-0 .*restarting in ([0-9.]+)s", server.log())]
    assert len(delays) >= 4 and all(d == delays[0] for d in delays[-4:]), delays
