"""Shadow traffic on OpenAI /v1/embeddings through a real `inferd serve`: an embedder's v1 and v2 side by
side with `shadow = { version = 2, fraction = 1.0 }`. Every answer is v1's; v2 embeds a copy of each
request, compared vector by vector in inferd_shadow_requests_total (v2 differs from v1 on one text
only); the response cache, the request counters and the tenant's quota see only the primary's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from inferd.gateway.keys import key_digest, new_key
from tests.conftest import ServerProc, start_server
from tests.fakes.hash_embedder import embed
from tests.integration.test_fleet import until
from tests.integration.test_shadow_fallback import metric, wait_ready, write_repo

KEY = new_key()
BURST = 6

EMBEDDER = """inputs = [{ name = "TEXT", datatype = "BYTES" }]
outputs = [{ name = "EMBEDDING", datatype = "FP32", shape = [8] }, { name = "TOKENS", datatype = "INT32" }]
workers = 1
version_policy = "all"
default_version = 1
max_wait_ms = 1
cache = { enabled = true }
traffic = { shadow = { version = 2, fraction = 1.0 } }

[versions.1]

[versions.2]
"""
V1 = "from tests.fakes.hash_embedder import HashEmbedder as Model  # noqa: F401\n"
V2 = """from tests.fakes.hash_embedder import HashEmbedder


class Model(HashEmbedder):
    def predict_batch(self, inputs):
        out = super().predict_batch(inputs)
        return [{**o, "EMBEDDING": o["EMBEDDING"] * 0} if t == b"odd" else o for t, o in zip(inputs, out)]
"""


@pytest.fixture
def shadowed(tmp_path: Path) -> Iterator[ServerProc]:
    repo = write_repo(tmp_path, {"emb": EMBEDDER})
    for version, source in (("1", V1), ("2", V2)):
        (repo / "emb" / version).mkdir()
        (repo / "emb" / version / "model.py").write_text(source)
    config = tmp_path / "inferd.toml"
    config.write_text(
        f'[tenants.acme]\napi_key_sha256 = ["{key_digest(KEY)}"]\nrequests_per_s = 0.01\nburst = {BURST}\n'
    )
    s = start_server(
        tmp_path, "--model-repo", str(repo), "--config", str(config), ready_path="/v2/health/live"
    )
    try:
        wait_ready(s, "/v2/health/ready", KEY)
        yield s
    finally:
        s.stop()


async def test_embeddings_shadow_copies_are_compared_and_never_reach_callers_the_cache_or_quotas(
    shadowed: ServerProc,
) -> None:
    server = shadowed
    texts = [f"text {i}" for i in range(BURST - 1)] + ["odd"]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
        for i, text in enumerate(texts):
            async with http.post(f"{server.url}/v1/embeddings", json={"model": "emb", "input": [text]}) as r:
                out = await r.json()
                assert r.status == 200, out
                # the whole burst: a copy charged to the tenant would leave the last request refused
                assert r.headers["x-ratelimit-remaining-requests"] == str(BURST - 1 - i)
                assert r.headers["X-Inferd-Model-Version"] == "1"
                assert r.headers["X-Inferd-Cache"] == "miss"
                assert out["data"][0]["embedding"] == embed(text.encode()).tolist()  # v1's, even for "odd"

        async def metrics() -> str:
            async with http.get(f"{server.url}/metrics") as r:
                return await r.text()

        async def copies_done() -> bool:
            return metric(await metrics(), "inferd_shadow_requests_total") >= BURST

        await until(copies_done, timeout_s=30)
        text = await metrics()
    shadow = {"model": "emb", "version": "2"}
    assert metric(text, "inferd_shadow_requests_total", **shadow, result="same") == BURST - 1
    assert metric(text, "inferd_shadow_requests_total", **shadow, result="different") == 1
    assert metric(text, "inferd_shadow_requests_total", result="error") == 0
    assert metric(text, "inferd_batch_size_count", model="emb", version="2") >= 1  # v2 really ran them
    assert metric(text, "inferd_requests_total", model="emb", version="2") == 0  # no caller asked v2
    assert metric(text, "inferd_cache_requests_total", model="emb") == BURST  # copies never touch it
