"""Scale from zero for an LLM model with a real `inferd serve` and sim-llm workers: at `[autoscale]
min_workers = 0` the model starts with no worker, is ready on demand, and its first requests (a chat
completion, a streamed completion and a gRPC ModelInfer, all at once) wait in the cold hold while the
scaling loop starts a worker (its warm-up takes 3 s), then are answered; a burst meanwhile, past the
cold bound (4 x max_num_seqs = 8 sequences), gets 429s with Retry-After for the excess, 200s with their
own tokens for the rest, and never a 5xx; the cold start is in `inferd_cold_start_seconds`. Idle, it
scales back to zero; then a request whose deadline is nearer than the measured start gets a 429 at once.
With `--frontends 2`, a follower (which runs no autoscaler) holds its requests too, instead of a 503: the
owner's scaling loop counts them from the follower's reported load, and the worker it starts joins both.

Bounded: one server at a time, one worker at most, a burst of 16 requests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import tritonclient.grpc.aio as triton_aio

from inferd.kinds.llm.sim_llm import sim_llm_tokens
from tests.checked_load import wait_for
from tests.conftest import ServerProc, start_server
from tests.integration.test_fleet import admin, ready_count, until
from tests.integration.test_grpc_stream import llm_inputs, text_of
from tests.integration.test_scale_from_zero import cold_starts, listeners, no_worker

MODEL_TOML = """builtin = "sim-llm"
workers = 0

[params]
step_base_ms = 5.0
warmup_ms = 3000.0

[params.scheduler]
max_num_seqs = 2

[autoscale]
min_workers = 0
max_workers = 1
scale_up_cooldown_s = 0.5
scale_down_cooldown_s = 0.5
scale_down_stabilization_s = 1.0
"""
BOUND = 8
"""The cold bound: 4 x max_num_seqs."""
BURST = 16


async def complete(
    http: aiohttp.ClientSession, server: ServerProc, prompt: str, timeout_ms: int | None = None
) -> tuple[int, dict, str | None]:
    headers = {} if timeout_ms is None else {"X-Request-Timeout-Ms": str(timeout_ms)}
    body = {"model": "sim-llm", "prompt": prompt, "max_tokens": 4, "seed": 1}
    async with http.post(f"{server.url}/v1/completions", json=body, headers=headers) as r:
        return r.status, await r.json(), r.headers.get("Retry-After")


async def chat(http: aiohttp.ClientSession, server: ServerProc) -> tuple[int, dict]:
    body = {"model": "sim-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


async def streamed(http: aiohttp.ClientSession, server: ServerProc, prompt: str) -> tuple[int, str]:
    body = {"model": "sim-llm", "prompt": prompt, "max_tokens": 4, "seed": 1, "stream": True}
    async with http.post(f"{server.url}/v1/completions", json=body) as r:
        return r.status, await r.text()


async def grpc_text(client: triton_aio.InferenceServerClient, prompt: str) -> str | None:
    result = await client.infer("sim-llm", llm_inputs(prompt, exclude=True, max_tokens=4, seed=1))
    return text_of(result)


def want(prompt: str) -> str:
    return " ".join(sim_llm_tokens(prompt, 1, 4))


async def test_an_llm_model_at_zero_workers_answers_its_first_requests_and_bounds_a_burst(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "sim-llm" / "1").mkdir(parents=True)
    (repo / "sim-llm" / "model.toml").write_text(MODEL_TOML)
    server = start_server(tmp_path, "--model-repo", str(repo))  # ready with no worker: served on demand
    try:
        async with aiohttp.ClientSession() as http:
            assert await ready_count(http, server) == 0
            async with http.get(f"{server.url}/v2/models/sim-llm/ready") as r:
                assert r.status == 200
            # the gRPC client connects first: grpcio's HTTP/2 handshake can break when the server forks the
            # worker's process during it ("Received unexpected settings ack"), whatever holds the request
            client = triton_aio.InferenceServerClient(server.grpc_target)
            assert await client.is_server_live()
            first = asyncio.gather(
                chat(http, server), streamed(http, server, "first streamed"), grpc_text(client, "first grpc")
            )
            await until(lambda: _held(http, server, 3), timeout_s=10)  # every edge's request waits
            burst = await asyncio.gather(*(complete(http, server, f"b{i}") for i in range(BURST)))  # warm-up: 3 s
            (status, answer), (s_status, s_text), g_text = await first
            await client.close()
            assert status == 200 and answer["choices"][0]["message"]["content"], answer
            assert s_status == 200 and s_text.rstrip().endswith("data: [DONE]"), s_text
            assert "".join(_pieces(s_text)) == want("first streamed")
            assert g_text == want("first grpc")
            statuses = [s for s, _, _ in burst]
            assert all(s in (200, 429) for s in statuses), burst
            assert statuses.count(200) >= BOUND - 3 and statuses.count(429) >= 1, statuses
            for i, (s, body, retry) in enumerate(burst):
                if s == 200:
                    assert body["choices"][0]["text"] == want(f"b{i}")
                else:
                    assert retry is not None and int(retry) >= 1 and "cold queue is full" in body["error"]["message"]
            count, seconds = await cold_starts(http, server, model="sim-llm")
            assert count == 1.0 and seconds > 2.5  # the worker's warm-up is 3 s
            row = (await admin(http, server, "/admin/models"))["llm_models"]["sim-llm"]
            changes = row["autoscaler"]["changes"]
            assert (changes[0]["from"], changes[0]["to"]) == (0, 1) and "from zero" in changes[0]["reason"]

            await until(lambda: no_worker(http, server), timeout_s=20)  # idle: back to zero
            status, body, retry = await complete(http, server, "late", timeout_ms=50)  # past the measured start
            assert status == 429 and retry is not None and int(retry) >= 1, body
            assert "to start" in body["error"]["message"]
            assert await ready_count(http, server) == 0  # refused at once: nothing woke
        assert "Traceback" not in server.log()
    finally:
        server.stop()


async def _held(http: aiohttp.ClientSession, server: ServerProc, n: int) -> bool:
    return (await admin(http, server, "/admin/models"))["llm_models"]["sim-llm"]["held"] == n


async def test_a_follower_holds_its_llm_requests_for_the_owners_scaling_loop(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "sim-llm" / "1").mkdir(parents=True)
    (repo / "sim-llm" / "model.toml").write_text(MODEL_TOML.replace("warmup_ms = 3000.0", "warmup_ms = 0.0"))
    server = start_server(tmp_path, "--model-repo", str(repo), "--frontends", "2")
    try:  # both front ends take connections (the first one ready answered start_server), the owner's admin API
        wait_for(lambda: listeners(server.port) == 2 and listeners(server.admin_port) == 1, 20, "both listening")
        connector = aiohttp.TCPConnector(force_close=True)  # a connection per request: both front ends get some
        async with aiohttp.ClientSession(connector=connector) as http:
            assert await ready_count(http, server) == 0
            results = await asyncio.gather(*(complete(http, server, f"f{i}") for i in range(BOUND)))
            assert [s for s, _, _ in results] == [200] * BOUND, results
            for i, (_, body, _) in enumerate(results):
                assert body["choices"][0]["text"] == want(f"f{i}")
            assert (await cold_starts(http, server, frontend="1", model="sim-llm"))[0] == 1.0  # the follower held some
    finally:
        server.stop()


def _pieces(sse: str) -> list[str]:
    """The text pieces of a streamed completion's events."""
    out = []
    for line in sse.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.extend(c["text"] for c in json.loads(line[6:])["choices"])
    return out
