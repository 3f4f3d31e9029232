"""A reload of the config file's model tables through a real `inferd serve`: `canary` (sim at versions 1
and 2) has its canary and response cache in `[models.canary]` of --config. A reload that changes the
canary's weight and the cache's ttl takes effect on the next requests; a reload whose A/B shares sum
to 0.9 is refused whole and the running split keeps serving; `inferd status` shows the split and its
history. Every answer of every inference route, streamed or not, names its model and version."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from typer.testing import CliRunner

from inferd.cli.main import app as cli_app
from tests.conftest import ServerProc, start_server
from tests.integration.test_traffic import COMMON, write_repo

EMBEDDER = """inputs = [{ name = "TEXT", datatype = "BYTES" }]
outputs = [{ name = "EMBEDDING", datatype = "FP32", shape = [8] }, { name = "TOKENS", datatype = "INT32" }]
workers = 1
"""
REPO = {"canary": COMMON + "[versions.2]\n", "emb": EMBEDDER, "chat": 'builtin = "sim-llm"\nworkers = 1\n'}
V1 = "/versions/1"
START = """
[models.canary]
traffic = { canary = { version = 2, weight = 0.1 } }
cache = { enabled = true, ttl_s = 600 }
"""


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reload") / "inferd.toml"


@pytest.fixture(scope="module")
def server(config_path: Path) -> Iterator[ServerProc]:
    root = config_path.parent
    config_path.write_text(START)
    repo = write_repo(root, REPO)
    (repo / "emb" / "1").mkdir()
    (repo / "emb" / "1" / "model.py").write_text(
        "from tests.fakes.hash_embedder import HashEmbedder as Model  # noqa: F401\n"
    )
    s = start_server(root, "--model-repo", str(repo), "--config", str(config_path))
    yield s
    assert s.stop() in (0, -15)


def body(text: str, name: str = "INPUT0") -> dict[str, Any]:
    return {"inputs": [{"name": name, "shape": [1], "datatype": "BYTES", "data": [text]}]}


async def infer(
    http: aiohttp.ClientSession, server: ServerProc, text: str, path: str = ""
) -> tuple[str, str | None]:
    """(the version that answered, X-Inferd-Cache); `path` "/versions/1" pins the version (each
    version has its own cache)."""
    async with http.post(f"{server.url}/v2/models/canary{path}/infer", json=body(text)) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-Inferd-Model-Version"], r.headers.get("X-Inferd-Cache")


async def admin(http: aiohttp.ClientSession, server: ServerProc, method: str, path: str) -> tuple[int, Any]:
    async with http.request(method, f"{server.admin_url}{path}") as r:
        return r.status, await r.json()


async def v2_share(http: aiohttp.ClientSession, server: ServerProc, tag: str, n: int = 200) -> float:
    answers = await asyncio.gather(*(infer(http, server, f"{tag}{i}") for i in range(n)))
    return Counter(version for version, _ in answers)["2"] / n


async def test_every_inference_route_names_its_model_and_version_streamed_or_not(server: ServerProc) -> None:
    routes: list[tuple[str, dict[str, Any], str]] = [
        ("/v2/models/canary/versions/2/infer", body("h"), "canary"),
        ("/v2/models/canary/versions/1/infer", body("h", name="WRONG"), "canary"),  # refused: a 400
        ("/v1/embeddings", {"model": "emb", "input": ["a b"]}, "emb"),
        ("/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 2}, "chat"),
        ("/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 2, "stream": True}, "chat"),
        ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}, "chat"),
        (
            "/v1/chat/completions",
            {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            "chat",
        ),
    ]
    async with aiohttp.ClientSession() as http:
        for path, payload, model in routes:
            async with http.post(f"{server.url}{path}", json=payload) as r:
                text = await r.text()
                assert r.status in (200, 400), (path, r.status, text)
                assert r.headers["X-Inferd-Model"] == model, path
                version = "2" if "versions/2" in path else "1"  # the split applies to neither
                assert r.headers["X-Inferd-Model-Version"] == version, path
                if payload.get("stream"):
                    assert r.headers["Content-Type"].startswith("text/event-stream")


async def test_a_reload_changes_the_canary_weight_and_the_cache_ttl_for_the_next_requests(
    server: ServerProc, config_path: Path
) -> None:
    async with aiohttp.ClientSession() as http:
        assert await v2_share(http, server, "before") <= 0.3  # binomial(200, 0.1): 0.3 is 9 sigma away
        assert await infer(http, server, "kept", V1) == ("1", "miss")
        assert await infer(http, server, "kept", V1) == ("1", "hit")  # inside the 600 s ttl
        await asyncio.to_thread(
            config_path.write_text, START.replace("weight = 0.1", "weight = 0.9").replace("600", "0.5")
        )
        await asyncio.sleep(0.6)  # "kept" is now older than the new ttl (and far within the old one)
        status, answer = await admin(http, server, "POST", "/admin/reload")
        assert status == 200, answer
        assert answer["changed"]["traffic"] == {"canary": "canary split replaced: v1 0.1, v2 0.9"}
        assert answer["changed"]["cache"]["canary:1"].startswith("on, ttl_s 0.5")
        assert answer["changed"]["needs_restart"] == []
        assert await v2_share(http, server, "after") >= 0.7  # binomial(200, 0.9): 0.7 is 9 sigma away
        # computed more than 0.5 s ago: the new ttl has expired it
        assert await infer(http, server, "kept", V1) == ("1", "miss")
        _, traffic = await admin(http, server, "GET", "/admin/traffic")
    (split,) = [s for s in traffic["splits"] if s["model"] == "canary"]
    assert split["weights"] == pytest.approx({"1": 0.1, "2": 0.9}) and split["state"] == "active"
    assert traffic["history"][-1]["event"] == "reloaded" and traffic["history"][-1]["model"] == "canary"
    assert "canary split replaced" in server.log()


async def test_a_refused_reload_changes_nothing_and_the_running_split_keeps_serving(
    server: ServerProc, config_path: Path
) -> None:
    async with aiohttp.ClientSession() as http:
        _, before = await admin(http, server, "GET", "/admin/traffic")
        await asyncio.to_thread(
            config_path.write_text,
            '[models.canary]\ntraffic = { ab = { arms = { "1" = 0.5, "2" = 0.4 } } }\n'
            "[models.canary.cache]\nenabled = false\n",
        )
        status, answer = await admin(http, server, "POST", "/admin/reload")
        assert status == 400
        assert "config not reloaded" in answer["error"] and "sum to 1" in answer["error"]
        _, after = await admin(http, server, "GET", "/admin/traffic")
        assert after["splits"] == before["splits"]
        assert await v2_share(http, server, "refused") >= 0.7  # the canary at 0.9 still serves
        await infer(http, server, "refused", V1)
        assert await infer(http, server, "refused", V1) == ("1", "hit")  # and the cache is still on

        await asyncio.to_thread(config_path.write_text, START + "max_wait_ms = 3\n")
        status, answer = await admin(http, server, "POST", "/admin/reload")
    assert status == 200 and answer["changed"]["needs_restart"] == ["models.canary.max_wait_ms"]
    assert "models.canary.max_wait_ms changed in the config file; it takes effect at the next restart" in (
        server.log()
    )


def test_status_shows_the_traffic_split_and_its_history(server: ServerProc) -> None:
    status = CliRunner().invoke(cli_app, ["status", "--admin-url", server.admin_url], env={"COLUMNS": "250"})
    assert status.exit_code == 0, status.output
    out = status.output
    row = next(line for line in out.splitlines() if "canary" in line and "v1 0.9, v2 0.1" in line)
    assert "v2" in row and "active" in row and "fixed" in row
    assert "traffic history (newest last):" in out
    assert "canary v2  reloaded: canary split replaced: v1 0.9, v2 0.1" in out
    snapshot = json.loads(
        CliRunner().invoke(cli_app, ["status", "--json", "--admin-url", server.admin_url]).output
    )
    assert [s["model"] for s in snapshot["traffic"]["splits"]] == ["canary"]
