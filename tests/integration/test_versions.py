"""Versions side by side through a real server: each served version has its own runtime and workers,
requests go to the version they name (else the default), every answer says which version gave it, and
`update --version N` moves the default to any version, lower included (rollback)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from inferd.models.sim import sim_digest
from tests.conftest import ServerProc, start_server
from tests.integration.test_fleet import Load, admin, until

SIDE_BY_SIDE = """builtin = "sim"
workers = 1
version_policy = "all"
default_version = 1
max_wait_ms = 2

[params]
base_ms = 5.0

[versions.1]

[versions.2]
max_wait_ms = 1
[versions.2.params]
per_item_ms = 0.5
"""


def infer_body(text: str) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}


@pytest.fixture
def side_by_side(tmp_path: Path) -> Iterator[ServerProc]:
    repo = tmp_path / "repo"
    (repo / "sim").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text(SIDE_BY_SIDE)
    s = start_server(tmp_path, "--model-repo", str(repo))
    yield s
    assert s.stop() in (0, -15)


async def test_each_version_answers_for_itself_and_the_default_moves(side_by_side: ServerProc) -> None:
    server = side_by_side
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/v2/models/sim") as r:
            meta = await r.json()
        assert meta["versions"] == ["1", "2"] and meta["kind"] == "batch"
        for version in ("1", "2"):
            async with http.post(
                f"{server.url}/v2/models/sim/versions/{version}/infer", json=infer_body("x")
            ) as r:
                body = await r.json()
                assert r.status == 200, body
                assert body["model_version"] == version
                assert r.headers["X-Inferd-Model-Version"] == version
                assert body["outputs"][0]["data"] == [sim_digest("sim", int(version), "x")]
            async with http.get(f"{server.url}/v2/models/sim/versions/{version}/ready") as r:
                assert r.status == 200
        async with http.get(f"{server.url}/v2/models/sim/versions/3/ready") as r:
            assert r.status == 404
            assert "served versions: [1, 2]" in (await r.json())["error"]
        async with http.post(f"{server.url}/v2/models/sim/infer", json=infer_body("y")) as r:
            assert (await r.json())["model_version"] == "1"  # default_version
        workers = (await admin(http, server, "/admin/workers"))["workers"]
        assert sorted(w["version"] for w in workers) == [1, 2]
        result = await admin(http, server, "/admin/models/sim/update?version=2", post=True)
        assert result == {"model": "sim", "from": 1, "to": 2, "replaced": 0}
        async with http.post(f"{server.url}/v2/models/sim/infer", json=infer_body("z")) as r:
            assert (await r.json())["model_version"] == "2"
        async with http.get(f"{server.url}/metrics") as r:
            metrics = await r.text()
    for version in ("1", "2"):
        assert f'inferd_requests_total{{model="sim",outcome="ok",protocol="http",version="{version}"}}' in metrics or (
            f'inferd_requests_total{{model="sim",version="{version}",outcome="ok"}}' in metrics
        )


ROLLBACK = """builtin = "sim"
workers = 2
max_batch_size = 50
max_wait_ms = 5

[params]
base_ms = 20.0
"""


async def test_rollback_to_a_lower_version_under_load_fails_no_request(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for v in (1, 2):
        (repo / "sim" / str(v)).mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text(ROLLBACK)
    server = start_server(tmp_path, "--model-repo", str(repo))
    try:
        load = Load(server.url, callers=8)
        async with aiohttp.ClientSession() as http:
            runner = asyncio.ensure_future(load.run())
            await until(lambda: load.ok > 30)
            result = await admin(http, server, "/admin/models/sim/update?version=1", post=True)
            seen = len(load.versions)
            await until(lambda: len(load.versions) > seen + 50)
            load.stop()
            await runner
            workers = (await admin(http, server, "/admin/workers"))["workers"]
            async with http.get(f"{server.url}/v2/models/sim") as r:
                meta = await r.json()
    finally:
        assert server.stop() in (0, -15)
    assert result == {"model": "sim", "from": 2, "to": 1, "replaced": 2}
    assert load.failures == []
    assert {"1", "2"} <= set(load.versions) and set(load.versions[-30:]) == {"1"}
    assert sorted(w["version"] for w in workers) == [1, 1]
    assert meta["versions"] == ["1"]
