"""An unload refuses the model's new requests at once, those another model hands to it as its fallback
too: while `back` drains (a request in flight), a request to `front` (no worker of its own, `fallback =
"back"`) is not handed to the model being unloaded (a 503 from front, not an answer from back that would
hold back's drain open). One real `inferd serve`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.conftest import start_server
from tests.integration.test_fleet import until

REPO = {
    "front": 'builtin = "sim"\nworkers = 0\ntraffic = { fallback = "back" }\n[params]\nbase_ms = 1.0\n',
    "back": 'builtin = "sim"\nworkers = 1\nmax_wait_ms = 1\n[params]\nbase_ms = 1500.0\n',
}
BODY = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}


async def test_a_model_being_unloaded_is_no_fallback(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name, toml in REPO.items():
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    server = start_server(tmp_path, "--model-repo", str(repo), ready_path="/v2/models/back/ready")  # front: no worker
    try:
        async with aiohttp.ClientSession() as http:

            async def infer(model: str) -> tuple[int, str | None]:
                async with http.post(f"{server.url}/v2/models/{model}/infer", json=BODY) as r:
                    return r.status, r.headers.get("X-Inferd-Fallback")

            async def index() -> dict[str, str]:
                async with http.post(f"{server.url}/v2/repository/index") as r:
                    return {row["name"]: row["reason"] for row in await r.json()}

            async def unload() -> int:
                async with http.post(f"{server.url}/v2/repository/models/back/unload") as r:
                    return r.status

            async def running() -> bool:
                async with http.get(f"{server.admin_url}/admin/workers") as r:
                    return sum(w["load"] for w in (await r.json())["workers"] if w["model"] == "back") > 0

            async def unloaded() -> bool:
                return (await index())["back"] == "unloaded"

            in_flight = asyncio.create_task(infer("back"))
            await until(lambda: running())
            unloading = asyncio.create_task(unload())
            await until(lambda: unloaded())  # the unload began; back drains its request
            status, fallback = await infer("front")
            assert (status, fallback) == (503, None)  # not handed to the model being unloaded
            assert await unloading == 200 and await in_flight == (200, None)  # what it held was answered
    finally:
        server.stop()
