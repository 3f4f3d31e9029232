"""Shadow traffic and fallback through a real `inferd serve`.

Fallback: `sim` has no worker and `fallback = "sim-b"`, so its requests are answered by sim-b, flagged
(X-Inferd-Fallback, X-Inferd-Model, parameters.fallback) and counted against the tenant like any other
answer; a tenant's own quota 429 is never handed over. A fallback to a model that is not served stops
the start with an error naming the fix.

Shadow: sim v1 and v2 side by side with `shadow = { version = 2, fraction = 1.0 }`: every answer is
v1's; v2 runs a copy of each, compared in inferd_shadow_requests_total; the response cache, the
request counters and the tenant's quota see only the primary's requests."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from inferd.gateway.keys import key_digest, new_key
from inferd.models.sim import sim_digest
from tests.conftest import ROOT, ServerProc, start_server
from tests.fakes.hash_embedder import embed
from tests.integration.test_fleet import until

ACME, FREE, ONLY_SIM = new_key(), new_key(), new_key()

EMBEDDER = """inputs = [{ name = "TEXT", datatype = "BYTES" }]
outputs = [{ name = "EMBEDDING", datatype = "FP32", shape = [8] }, { name = "TOKENS", datatype = "INT32" }]
"""
FALLBACK_REPO = {
    "sim": 'builtin = "sim"\nworkers = 0\ntraffic = { fallback = "sim-b" }\n[params]\nbase_ms = 1.0\n',
    "sim-b": 'builtin = "sim"\nworkers = 1\n[params]\nbase_ms = 1.0\n',
    "busy": 'builtin = "sim"\nworkers = 1\nmax_batch_size = 1\nmax_queue_size = 1\n'
    'traffic = { fallback = "sim-b" }\n[params]\nbase_ms = 300.0\n',
    "chat": 'builtin = "sim-llm"\nworkers = 0\ntraffic = { fallback = "chat-b" }\n',
    "chat-b": 'builtin = "sim-llm"\nworkers = 1\n',
    "emb": EMBEDDER + 'workers = 0\ntraffic = { fallback = "emb-b" }\n',
    "emb-b": EMBEDDER + "workers = 1\n",
}
TENANTS = f"""
[tenants.acme]
api_key_sha256 = ["{key_digest(ACME)}"]
requests_per_s = 0.01
burst = 3

[tenants.free]
api_key_sha256 = ["{key_digest(FREE)}"]

[tenants.only-sim]
api_key_sha256 = ["{key_digest(ONLY_SIM)}"]
models = ["sim"]
"""
SHADOW_MODEL = """builtin = "sim"
workers = 1
version_policy = "all"
default_version = 1
max_wait_ms = 1
cache = { enabled = true }
traffic = { shadow = { version = 2, fraction = 1.0 } }

[params]
base_ms = 1.0

[versions.1]

[versions.2]
"""


def write_repo(root: Path, models: dict[str, str]) -> Path:
    repo = root / "repo"
    for name, text in models.items():
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(text)
    return repo


def body(text: str) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def fallback_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("fallback")
    config = root / "inferd.toml"
    config.write_text(TENANTS)
    repo = write_repo(root, FALLBACK_REPO)
    for name in ("emb", "emb-b"):
        (repo / name / "1").mkdir()
        (repo / name / "1" / "model.py").write_text(
            "from tests.fakes.hash_embedder import HashEmbedder as Model  # noqa: F401\n"
        )
    s = start_server(root, "--model-repo", str(repo), "--config", str(config), ready_path="/v2/health/live")
    try:
        for ready in ("sim-b", "chat-b", "emb-b", "busy"):  # the others never are: no worker
            wait_ready(s, f"/v2/models/{ready}/ready", FREE)
        yield s
    finally:
        s.stop()


def wait_ready(server: ServerProc, path: str, key: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(f"{server.url}{path}", headers={"Authorization": f"Bearer {key}"})
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{path} not ready within {timeout_s} s:\n{server.log()}")


async def test_a_model_without_workers_is_answered_by_its_fallback_flagged(
    fallback_server: ServerProc,
) -> None:
    server = fallback_server
    auth = {"Authorization": f"Bearer {FREE}"}
    async with aiohttp.ClientSession() as http:
        for i in range(6):  # past the breaker's threshold: later requests skip sim at once
            async with http.post(f"{server.url}/v2/models/sim/infer", json=body(f"x{i}"), headers=auth) as r:
                out = await r.json()
                assert r.status == 200, out
                assert r.headers["X-Inferd-Fallback"] == "sim-b"
                assert r.headers["X-Inferd-Model"] == "sim-b"
                assert r.headers["X-Inferd-Model-Version"] == "1"
                assert out["model_name"] == "sim-b" and out["parameters"]["fallback"] == "sim-b"
                assert out["outputs"][0]["data"] == [sim_digest("sim-b", 1, f"x{i}")]
        async with http.post(f"{server.url}/v2/models/sim-b/infer", json=body("y"), headers=auth) as r:
            assert r.status == 200 and "X-Inferd-Fallback" not in r.headers  # asked directly: no flag
        async with http.get(f"{server.url}/metrics") as r:
            text = await r.text()
    assert metric(text, "inferd_fallback_requests_total", model="sim", fallback="sim-b") == 6
    assert (
        metric(text, "inferd_fallback_requests_total", reason="unavailable") == 3
    )  # then the breaker opened
    assert metric(text, "inferd_fallback_requests_total", reason="breaker_open") == 3


async def test_a_full_queue_hands_the_overflow_to_the_fallback(fallback_server: ServerProc) -> None:
    server = fallback_server
    auth = {"Authorization": f"Bearer {FREE}"}

    async def one(http: aiohttp.ClientSession, i: int) -> tuple[int, str | None]:
        async with http.post(f"{server.url}/v2/models/busy/infer", json=body(f"b{i}"), headers=auth) as r:
            out = await r.json()
            assert r.status == 200, out
            digest = sim_digest(out["model_name"], 1, f"b{i}")
            assert out["outputs"][0]["data"] == [digest]
            return r.status, r.headers.get("X-Inferd-Fallback")

    async with aiohttp.ClientSession() as http:  # 8 at once: busy holds one batch of 1 and queues 1
        answers = await asyncio.gather(*(one(http, i) for i in range(8)))
        async with http.get(f"{server.url}/metrics") as r:
            text = await r.text()
    flags = [flag for _, flag in answers]
    assert None in flags and "sim-b" in flags
    assert metric(text, "inferd_fallback_requests_total", model="busy", reason="queue_full") == flags.count(
        "sim-b"
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_an_llm_route_falls_back_to_another_llm(fallback_server: ServerProc, stream: bool) -> None:
    server = fallback_server
    auth = {"Authorization": f"Bearer {FREE}"}
    request = {"model": "chat", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 3}
    async with aiohttp.ClientSession() as http:
        for _ in range(4):
            async with http.post(
                f"{server.url}/v1/chat/completions", json={**request, "stream": stream}, headers=auth
            ) as r:
                text = await r.text()
                assert r.status == 200, text
                assert r.headers["X-Inferd-Fallback"] == "chat-b" and r.headers["X-Inferd-Model"] == "chat-b"
                assert r.headers["X-Inferd-Model-Version"] == "1"
                assert ("data: [DONE]" in text) if stream else ('"finish_reason"' in text)
        async with http.get(f"{server.url}/metrics") as r:
            metrics = await r.text()
    assert metric(metrics, "inferd_fallback_requests_total", model="chat", fallback="chat-b") >= 4


async def test_embeddings_fall_back_to_another_embedder(fallback_server: ServerProc) -> None:
    server = fallback_server
    auth = {"Authorization": f"Bearer {FREE}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{server.url}/v1/embeddings", json={"model": "emb", "input": ["a b", "c"]}, headers=auth
        ) as r:
            out = await r.json()
            assert r.status == 200, out
            assert r.headers["X-Inferd-Fallback"] == "emb-b" and r.headers["X-Inferd-Model"] == "emb-b"
    assert [d["embedding"] for d in out["data"]] == [embed(b"a b").tolist(), embed(b"c").tolist()]


async def test_a_tenants_quota_429_is_never_handed_to_the_fallback(fallback_server: ServerProc) -> None:
    server = fallback_server
    auth = {"Authorization": f"Bearer {ACME}"}
    statuses = []
    async with aiohttp.ClientSession() as http:
        for i in range(4):  # a burst of 3: fallback answers count against the tenant like any other
            async with http.post(f"{server.url}/v2/models/sim/infer", json=body(f"q{i}"), headers=auth) as r:
                statuses.append((r.status, r.headers.get("X-Inferd-Fallback")))
                out = await r.json()
    assert statuses == [(200, "sim-b")] * 3 + [(429, None)]
    assert "quota" in out["error"]


async def test_a_tenant_that_may_not_call_the_fallback_gets_the_primarys_refusal(
    fallback_server: ServerProc,
) -> None:
    server = fallback_server
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {ONLY_SIM}"}
        async with http.post(f"{server.url}/v2/models/sim/infer", json=body("z"), headers=headers) as r:
            assert r.status == 503, await r.text()
            assert "X-Inferd-Fallback" not in r.headers


def test_an_unknown_fallback_stops_the_start_naming_the_fix(tmp_path: Path) -> None:
    repo = write_repo(tmp_path, {"sim": 'builtin = "sim"\ntraffic = { fallback = "nope" }\n'})
    proc = subprocess.run(
        [sys.executable, "-m", "inferd.cli.main", "serve", "--port", "0", "--model-repo", str(repo)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        "error: model 'sim': traffic.fallback = 'nope' is not a served model: serve 'nope' or remove the fallback"
    )


@pytest.fixture
def shadowed(tmp_path: Path) -> Iterator[ServerProc]:
    repo = write_repo(tmp_path, {"sim": SHADOW_MODEL})
    config = tmp_path / "inferd.toml"
    config.write_text(
        f'[tenants.acme]\napi_key_sha256 = ["{key_digest(ACME)}"]\nrequests_per_s = 0.01\nburst = 8\n'
    )
    s = start_server(
        tmp_path, "--model-repo", str(repo), "--config", str(config), ready_path="/v2/health/live"
    )
    try:
        wait_ready(s, "/v2/health/ready", ACME)
        yield s
    finally:
        s.stop()


async def test_shadow_copies_run_on_v2_and_never_reach_callers_the_cache_or_the_counters(
    shadowed: ServerProc,
) -> None:
    server = shadowed
    n = 8  # the tenant's whole burst: a copy charged to it would leave the last request refused
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ACME}"}) as http:
        for i in range(n):
            async with http.post(f"{server.url}/v2/models/sim/infer", json=body(f"s{i}")) as r:
                out = await r.json()
                assert r.status == 200, out
                assert r.headers["x-ratelimit-remaining-requests"] == str(n - 1 - i)
                assert r.headers["X-Inferd-Model-Version"] == "1" and out["model_version"] == "1"
                assert out["outputs"][0]["data"] == [sim_digest("sim", 1, f"s{i}")]
                assert r.headers["X-Inferd-Cache"] == "miss"

        async def metrics() -> str:
            async with http.get(f"{server.url}/metrics") as r:
                return await r.text()

        async def copies_done() -> bool:
            return metric(await metrics(), "inferd_shadow_requests_total") >= n

        await until(copies_done, timeout_s=30)
        text = await metrics()
    # sim's answers carry its version in the digest: v2's always differ from v1's
    assert metric(text, "inferd_shadow_requests_total", model="sim", version="2", result="different") == n
    assert metric(text, "inferd_shadow_requests_total", result="same") == 0
    assert metric(text, "inferd_batch_size_count", model="sim", version="2") >= 1  # v2 really ran them
    assert metric(text, "inferd_requests_total", model="sim", version="2") == 0  # no caller asked v2
    assert metric(text, "inferd_requests_total", model="sim", version="1") == n
    assert metric(text, "inferd_cache_requests_total", model="sim") == n  # the copies never touch the cache
