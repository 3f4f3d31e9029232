"""The response cache in a real `inferd serve` with `sim`, `sim-llm` and a tiny embedder at
cache = { enabled = true }; and a second server with two tenants, whose answers never cross."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import aiohttp
import pytest

from inferd.gateway.keys import key_digest, new_key
from inferd.models.sim import sim_digest
from tests.conftest import ServerProc, start_server
from tests.fakes.hash_embedder import embed as embed_text

BASE_MS = 200  # long enough that two requests sent together overlap the first one's computation


REPO = {
    "sim": f'builtin = "sim"\ncache = {{ enabled = true, ttl_s = 600 }}\n[params]\nbase_ms = {BASE_MS}\n',
    "sim-llm": 'builtin = "sim-llm"\ncache = { enabled = true }\n',
    "embedder": """cache = { enabled = true }
inputs = [{ name = "TEXT", datatype = "BYTES" }]
outputs = [{ name = "EMBEDDING", datatype = "FP32", shape = [8] }, { name = "TOKENS", datatype = "INT32" }]
""",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("cache")
    for name, toml in REPO.items():
        (tmp / "models" / name / "1").mkdir(parents=True)
        (tmp / "models" / name / "model.toml").write_text(toml)
    (tmp / "models" / "embedder" / "1" / "model.py").write_text(
        "from tests.fakes.hash_embedder import HashEmbedder as Model  # noqa: F401\n"
    )
    s = start_server(tmp, "--model-repo", str(tmp / "models"))
    yield s
    assert s.stop() in (0, -15)


def body(rid: str, texts: list[str]) -> dict:
    return {
        "id": rid,
        "inputs": [{"name": "INPUT0", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
    }


async def infer(http: aiohttp.ClientSession, server: ServerProc, payload: dict) -> tuple[int, dict, dict]:
    async with http.post(f"{server.url}/v2/models/sim/infer", json=payload) as r:
        return r.status, await r.json(), {k.lower(): v for k, v in r.headers.items()}


async def test_repeat_is_a_hit_with_the_same_outputs_and_the_callers_own_id(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        s1, first, h1 = await infer(http, server, body("caller-1", ["alpha", "beta"]))
        s2, second, h2 = await infer(http, server, body("caller-2", ["alpha", "beta"]))
    assert (s1, s2) == (200, 200)
    assert (h1["x-inferd-cache"], h2["x-inferd-cache"]) == ("miss", "hit")
    assert (first["id"], second["id"]) == ("caller-1", "caller-2")
    assert second["outputs"] == first["outputs"]
    assert first["outputs"][0]["data"] == [sim_digest("sim", 1, "alpha"), sim_digest("sim", 1, "beta")]
    assert (first["parameters"]["cache"], second["parameters"]["cache"]) == ("miss", "hit")
    assert h2["x-inferd-batch-id"] == h1["x-inferd-batch-id"]  # the hit reports the run that computed it
    assert float(h1["x-inferd-compute-ms"]) >= BASE_MS


async def test_different_inputs_miss_and_the_ids_and_output_spelling_do_not_matter(
    server: ServerProc,
) -> None:
    async with aiohttp.ClientSession() as http:
        _, _, h1 = await infer(http, server, body("a", ["gamma"]))
        _, _, h2 = await infer(http, server, body("b", ["delta"]))
        _, _, h3 = await infer(http, server, body("c", ["gamma", "delta"]))
        _, _, h4 = await infer(http, server, {**body("d", ["gamma"]), "outputs": [{"name": "OUTPUT0"}]})
    assert [h["x-inferd-cache"] for h in (h1, h2, h3)] == ["miss", "miss", "miss"]
    assert h4["x-inferd-cache"] == "hit"  # naming sim's only output asks for what the default returns


async def test_identical_concurrent_requests_run_once(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        replies = await asyncio.gather(*(infer(http, server, body(f"c{i}", ["epsilon"])) for i in range(2)))
    assert sorted(h["x-inferd-cache"] for _, _, h in replies) == ["hit", "miss"]
    assert len({h["x-inferd-batch-id"] for _, _, h in replies}) == 1
    assert [b["id"] for _, b, _ in replies] == ["c0", "c1"]


async def test_failed_answers_are_bypass_and_never_cached(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        s1, _, h1 = await infer(http, server, body("f1", ["!fail now"]))
        s2, _, h2 = await infer(http, server, body("f2", ["!fail now"]))
        s3, _, h3 = await infer(
            http, server, {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1]}]}
        )
    assert s1 == s2 != 200
    assert (h1["x-inferd-cache"], h2["x-inferd-cache"]) == ("bypass", "bypass")
    assert (s3, h3["x-inferd-cache"]) == (400, "bypass")


async def test_metrics_count_results_and_what_is_held(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        await infer(http, server, body("m1", ["zeta"]))
        await infer(http, server, body("m2", ["zeta"]))
        async with http.get(f"{server.url}/metrics") as r:
            text = await r.text()

    def sample(name: str, labels: str) -> float:
        match = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
        assert match, f"{name}{{{labels}}} not in /metrics"
        return float(match.group(1))

    assert sample("inferd_cache_requests_total", 'model="sim",result="hit"') >= 1
    assert sample("inferd_cache_requests_total", 'model="sim",result="miss"') >= 1
    assert sample("inferd_cache_entries", 'model="sim"') >= 1
    assert sample("inferd_cache_bytes", 'model="sim"') > 0


async def complete(
    http: aiohttp.ClientSession, server: ServerProc, path: str, **fields: object
) -> tuple[dict, str]:
    payload = {"model": "sim-llm", "max_tokens": 8, **fields}
    async with http.post(f"{server.url}/v1/{path}", json=payload) as r:
        assert r.status == 200, await r.text()
        cache = r.headers["x-inferd-cache"]
        return (await r.json() if not fields.get("stream") else {"raw": await r.text()}), cache


async def test_deterministic_text_generation_is_cached_with_its_own_id(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        first, c1 = await complete(http, server, "completions", prompt="the cache", temperature=0)
        second, c2 = await complete(http, server, "completions", prompt="the cache", temperature=0)
        chat = {"messages": [{"role": "user", "content": "hello"}], "seed": 7, "temperature": 1.0}
        third, c3 = await complete(http, server, "chat/completions", **chat)
        fourth, c4 = await complete(http, server, "chat/completions", **chat)
    assert (c1, c2, c3, c4) == ("miss", "hit", "miss", "hit")
    assert second["choices"] == first["choices"] and second["usage"] == first["usage"]
    assert second["id"] != first["id"]
    assert fourth["choices"] == third["choices"] and fourth["id"] != third["id"]


async def test_sampled_or_streamed_generation_bypasses_the_cache(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        _, sampled = await complete(http, server, "completions", prompt="p", temperature=0.7)
        _, unseeded = await complete(http, server, "completions", prompt="p", seed=-1)
        _, streamed = await complete(http, server, "completions", prompt="p", temperature=0, stream=True)
    assert (sampled, unseeded, streamed) == ("bypass", "bypass", "bypass")


async def test_embeddings_are_cached_per_text_list_and_encoding(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:

        async def embed(texts: list[str], encoding: str = "float") -> tuple[dict, str]:
            payload = {"model": "embedder", "input": texts, "encoding_format": encoding}
            async with http.post(f"{server.url}/v1/embeddings", json=payload) as r:
                assert r.status == 200, await r.text()
                return await r.json(), r.headers["x-inferd-cache"]

        first, c1 = await embed(["one fish", "two fish"])
        second, c2 = await embed(["one fish", "two fish"])
        _, c3 = await embed(["two fish", "one fish"])
        _, c4 = await embed(["one fish", "two fish"], "base64")
    assert (c1, c2, c3, c4) == ("miss", "hit", "miss", "miss")
    assert second == first
    assert first["data"][1]["embedding"] == pytest.approx(embed_text(b"two fish").tolist())
    assert first["usage"]["prompt_tokens"] == 4


KEY_A, KEY_B = new_key(), new_key()


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("cache-tenants")
    (tmp / "models" / "sim" / "1").mkdir(parents=True)
    (tmp / "models" / "sim" / "model.toml").write_text(REPO["sim"])
    (tmp / "inferd.toml").write_text(
        f'[tenants.alpha]\napi_key_sha256 = ["{key_digest(KEY_A)}"]\n'
        f'[tenants.beta]\napi_key_sha256 = ["{key_digest(KEY_B)}"]\n'
    )
    s = start_server(tmp, "--model-repo", str(tmp / "models"), "--config", str(tmp / "inferd.toml"))
    yield s
    assert s.stop() in (0, -15)


async def test_one_tenants_answer_never_serves_another(tenant_server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:

        async def ask(key: str, rid: str) -> tuple[dict, str]:
            url = f"{tenant_server.url}/v2/models/sim/infer"
            async with http.post(url, json=body(rid, ["secret"]), headers={"X-API-Key": key}) as r:
                assert r.status == 200, await r.text()
                return await r.json(), r.headers["x-inferd-cache"]

        (a1, ca1), (a2, ca2) = await ask(KEY_A, "a1"), await ask(KEY_A, "a2")
        (b1, cb1), (b2, cb2) = await ask(KEY_B, "b1"), await ask(KEY_B, "b2")
    assert (ca1, ca2, cb1, cb2) == ("miss", "hit", "miss", "hit")
    assert [r["id"] for r in (a1, a2, b1, b2)] == ["a1", "a2", "b1", "b2"]
    assert a1["parameters"]["batch_id"] != b1["parameters"]["batch_id"]  # beta's answer was computed anew
    assert b2["outputs"] == a1["outputs"]  # the same deterministic answer, from beta's own entry
