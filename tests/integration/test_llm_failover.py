"""LLM routing, failover and overload through the real server and real sim-llm worker processes.

- a worker SIGKILLed mid-stream: every stream still delivers exactly sim_llm_tokens(prompt, seed, n);
- a worker SIGSTOPped mid-stream (hung: no step while its sequences run): the watchdog kills it, its
  streams resume on the other worker, correct to the token, and the supervisor replaces it;
- prefix affinity: a request sharing a running request's prompt prefix joins its worker (and hits its
  prefix cache) although another worker is idle;
- overload (RELIABILITY L6): beyond the engines' waiting bounds, a fast 429 with Retry-After before the
  response starts; every admitted stream stays correct and the running one keeps its token pace.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from inferd.kinds.llm.sim_llm import sim_llm_tokens
from tests.conftest import ServerProc, alive, start_server

SHARED = " ".join(f"w{i}" for i in range(64))
"""A 64-word prompt prefix: 4 full KV blocks of 16 tokens."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("llm-failover")
    repo = root / "repo"
    models = {
        "sim-llm": 'builtin = "sim-llm"\nworkers = 2\n[params]\nstep_base_ms = 15.0\nhang_timeout_s = 3.0\n',
        "tight": (
            'builtin = "sim-llm"\nworkers = 1\n[params]\nstep_base_ms = 10.0\n'
            "[params.scheduler]\nmax_num_seqs = 4\nmax_waiting_seqs = 2\n"
        ),
    }
    for name, toml in models.items():
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    s = start_server(root, "--model-repo", str(repo))
    yield s
    assert s.stop() in (0, -15)


@dataclass
class Result:
    status: int
    headers: dict[str, str]
    text: str = ""
    error: dict[str, Any] | None = None
    chunk_times: list[float] = field(default_factory=list)


async def complete(
    http: aiohttp.ClientSession,
    server: ServerProc,
    model: str,
    prompt: str,
    seed: int,
    n: int,
    on_chunk: Callable[[Result], None] | None = None,
    tenant: str = "",
) -> Result:
    """One streamed completion, read as raw SSE so error events and headers are visible."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "seed": seed, "stream": True}
    headers = {"X-Tenant": tenant} if tenant else {}
    async with http.post(f"{server.url}/v1/completions", json=body, headers=headers) as r:
        out = Result(r.status, {k.lower(): v for k, v in r.headers.items()})
        if r.status != 200:
            out.error = await r.json()
            return out
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event
            elif event["choices"]:
                out.text += event["choices"][0]["text"]
                out.chunk_times.append(time.monotonic())
                if on_chunk is not None:
                    on_chunk(out)
    return out


def expected(prompt: str, seed: int, n: int) -> str:
    return " ".join(sim_llm_tokens(prompt, seed, n))


async def llm_workers(http: aiohttp.ClientSession, server: ServerProc, model: str) -> list[dict[str, Any]]:
    async with http.get(f"{server.admin_url}/admin/workers") as r:
        return [w for w in (await r.json())["workers"] if w["model"] == model and w["state"] == "ready"]


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def prefix_hit_tokens(http: aiohttp.ClientSession, server: ServerProc, model: str) -> float:
    async with http.get(f"{server.url}/metrics") as r:
        text = await r.text()
    found = re.search(
        rf'^inferd_llm_prefix_cache_hit_tokens_total{{model="{model}",version="1"}} ([0-9.e+]+)$', text, re.M
    )
    assert found, "inferd_llm_prefix_cache_hit_tokens_total missing from /metrics"
    return float(found.group(1))


async def test_request_sharing_a_running_prefix_joins_its_worker(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        await until(lambda: _n_ready(http, server, "sim-llm", 2))
        started = asyncio.Event()
        first = asyncio.ensure_future(
            complete(http, server, "sim-llm", SHARED + " first", 1, 40, lambda r: started.set())
        )
        await started.wait()  # it runs, so its worker holds one more sequence than the other
        hits_before = await prefix_hit_tokens(http, server, "sim-llm")
        same = await complete(http, server, "sim-llm", SHARED + " second", 2, 4)
        other = await complete(http, server, "sim-llm", "an unrelated prompt", 3, 4)
        hits_after = await prefix_hit_tokens(http, server, "sim-llm")
        long = await first
    assert long.text == expected(SHARED + " first", 1, 40)
    assert same.text == expected(SHARED + " second", 2, 4)
    assert same.headers["x-inferd-worker"] == long.headers["x-inferd-worker"]
    assert other.headers["x-inferd-worker"] != long.headers["x-inferd-worker"]  # least-loaded
    assert hits_after - hits_before >= 64  # the shared blocks came from that worker's prefix cache


async def test_streams_survive_a_worker_killed_mid_stream(server: ServerProc) -> None:
    n_streams, n = 8, 60
    prompts = [(f"failover caller {i} keeps talking", i) for i in range(n_streams)]
    async with aiohttp.ClientSession() as http:
        await until(lambda: _n_ready(http, server, "sim-llm", 2))
        started: set[int] = set()
        all_started = asyncio.Event()

        def progress(i: int) -> Callable[[Result], None]:
            def seen(r: Result) -> None:
                if len(r.chunk_times) >= 3:
                    started.add(i)
                    if len(started) == n_streams:
                        all_started.set()

            return seen

        tasks = [
            asyncio.ensure_future(complete(http, server, "sim-llm", p, seed, n, progress(i)))
            for i, (p, seed) in enumerate(prompts)
        ]
        await asyncio.wait_for(all_started.wait(), 20)
        workers = await llm_workers(http, server, "sim-llm")
        victim = max(workers, key=lambda w: w["live_sequences"])
        assert victim["live_sequences"] > 0
        os.kill(victim["pid"], signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    on_victim = [r for r in results if r.headers["x-inferd-worker"] == victim["worker_id"]]
    assert on_victim, "no stream ran on the killed worker"
    for r, (prompt, seed) in zip(results, prompts, strict=True):
        assert r.error is None, r.error
        assert r.text == expected(prompt, seed, n)
    assert "moving its" in server.log()


async def test_streams_survive_a_stopped_worker_which_is_killed_and_replaced(server: ServerProc) -> None:
    n_streams, n = 6, 120
    prompts = [(f"stopped caller {i} waits", 100 + i) for i in range(n_streams)]
    async with aiohttp.ClientSession() as http:
        await until(lambda: _n_ready(http, server, "sim-llm", 2))
        going = asyncio.Event()
        tasks = [
            asyncio.ensure_future(
                complete(
                    http, server, "sim-llm", p, seed, n, lambda r: len(r.chunk_times) >= 3 and going.set()
                )
            )
            for p, seed in prompts
        ]
        await asyncio.wait_for(going.wait(), 20)
        workers = await llm_workers(http, server, "sim-llm")
        victim = max(workers, key=lambda w: w["live_sequences"])
        assert victim["live_sequences"] > 0
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            if alive(victim["pid"]):  # the watchdog did not kill it: let it go on for the teardown
                os.kill(victim["pid"], signal.SIGCONT)
        for r, (prompt, seed) in zip(results, prompts, strict=True):
            assert r.error is None, r.error
            assert r.text == expected(prompt, seed, n)
        assert any(r.headers["x-inferd-worker"] == victim["worker_id"] for r in results)

        async def replaced() -> bool:
            ids = {w["worker_id"] for w in await llm_workers(http, server, "sim-llm")}
            return len(ids) == 2 and victim["worker_id"] not in ids

        await until(replaced)
    assert not alive(victim["pid"])
    assert f"killing LLM worker {victim['worker_id']}" in server.log()
    assert "hung: no engine step" in server.log()


async def test_overload_gives_fast_429_and_running_streams_keep_their_pace(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        await until(lambda: _n_ready(http, server, "tight", 1))
        baseline_done = asyncio.Event()
        witness_prompt = "a long running witness stream"
        witness = asyncio.ensure_future(
            complete(
                http,
                server,
                "tight",
                witness_prompt,
                9,
                150,
                lambda r: len(r.chunk_times) >= 30 and baseline_done.set(),
            )
        )
        await baseline_done.wait()
        flood_start = time.monotonic()

        async def timed(i: int) -> tuple[Result, float]:
            t0 = time.monotonic()
            r = await complete(http, server, "tight", f"flood {i}", i, 20)
            return r, time.monotonic() - t0

        flood = await asyncio.gather(*(timed(i) for i in range(30)))
        flood_end = time.monotonic()
        w = await witness
    refused = [(r, dt) for r, dt in flood if r.status == 429]
    served = [(r, dt) for r, dt in flood if r.status == 200]
    assert refused and served, [r.status for r, _ in flood]
    for r, dt in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.error is not None and r.error["error"]["type"]
        assert dt < 1.0, f"a refusal took {dt:.3f}s"
    for (r, _), i in zip(flood, range(30), strict=True):
        if r.status == 200:
            assert r.text == expected(f"flood {i}", i, 20)
    assert w.text == expected(witness_prompt, 9, 150)
    gaps = [b - a for a, b in zip(w.chunk_times, w.chunk_times[1:], strict=False)]
    before = [g for g, t in zip(gaps, w.chunk_times[1:], strict=False) if t < flood_start]
    during = [g for g, t in zip(gaps, w.chunk_times[1:], strict=False) if flood_start <= t <= flood_end]
    assert during, "the flood ended before the witness produced another token"
    assert statistics.median(during) <= 3 * statistics.median(before) + 0.01
    async with aiohttp.ClientSession() as http, http.get(f"{server.url}/metrics") as r:
        text = await r.text()
    # LLM refusals are accounted like every other model's: by outcome, and by reason
    rejected = re.search(
        r'^inferd_requests_total\{model="tight",outcome="rejected",protocol="http",version="1"\} (\S+)$', text, re.M
    )
    reason = re.search(
        r'^inferd_requests_rejected_total\{model="tight",reason="llm_queue_full",version="1"\} (\S+)$',
        text,
        re.M,
    )
    assert rejected and float(rejected.group(1)) >= len(refused)
    assert reason and float(reason.group(1)) >= len(refused)


async def _n_ready(http: aiohttp.ClientSession, server: ServerProc, model: str, n: int) -> bool:
    return len(await llm_workers(http, server, model)) >= n
