"""Traffic splits through a real server, one repository with three sim models at versions 1 and 2:
`canary` sends 30 % of unversioned requests to v2 (versioned ones are never split), `ab` splits by
the X-User header (one value, one version, always), and `failing`'s v2 raises on every input: its
canary is rolled back to weight 0 by itself, with the metric and the log line saying why. A traffic
table naming a version that is not served stops `inferd serve` before start."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from inferd.models.sim import sim_digest
from tests.conftest import ROOT, ServerProc, start_server
from tests.integration.test_fleet import admin

COMMON = """builtin = "sim"
workers = 1
version_policy = "all"
default_version = 1
max_wait_ms = 1

[params]
base_ms = 1.0
per_item_ms = 0.0

[versions.1]
"""

MODELS = {
    "canary": COMMON + "[versions.2]\n\n[traffic]\ncanary = { version = 2, weight = 0.3 }\n",
    "ab": COMMON
    + '[versions.2]\n\n[traffic]\nab = { arms = { "1" = 0.5, "2" = 0.5 }, sticky_by = "header:X-User" }\n',
    "failing": COMMON
    + '[versions.2.params]\nfail_prefix = "x"\n\n'  # every input of the test fails on v2 (not warm-up)
    + "[traffic]\ncanary = { version = 2, weight = 0.3 }\n"
    + "rollback = { max_error_ratio = 0.5, short_window_s = 10, long_window_s = 20, min_requests = 5 }\n",
}


def write_repo(root: Path, models: dict[str, str]) -> Path:
    repo = root / "repo"
    for name, toml in models.items():
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("traffic")
    s = start_server(root, "--model-repo", str(write_repo(root, MODELS)))
    yield s
    assert s.stop() in (0, -15)


def body(text: str) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}


async def infer(
    http: aiohttp.ClientSession, server: ServerProc, model: str, text: str, path: str = "", **headers: str
) -> tuple[int, str | None, dict]:
    """(status, X-Inferd-Model-Version, body); the answer's digest says which version computed it."""
    async with http.post(
        f"{server.url}/v2/models/{model}{path}/infer", json=body(text), headers=headers
    ) as r:
        answer = await r.json()
        if r.status == 200:
            assert r.headers["X-Inferd-Model"] == model
            version = answer["model_version"]
            assert answer["outputs"][0]["data"] == [sim_digest(model, int(version), text)]
        return r.status, r.headers.get("X-Inferd-Model-Version"), answer


async def metrics(http: aiohttp.ClientSession, server: ServerProc) -> str:
    async with http.get(f"{server.url}/metrics") as r:
        return await r.text()


async def test_a_canary_gets_its_share_of_unversioned_requests_and_never_a_versioned_one(
    server: ServerProc,
) -> None:
    async with aiohttp.ClientSession() as http:
        unversioned = await asyncio.gather(*(infer(http, server, "canary", f"u{i}") for i in range(300)))
        pinned = await asyncio.gather(
            *(infer(http, server, "canary", f"p{i}", "/versions/1") for i in range(40)),
            *(
                infer(http, server, "canary", f"h{i}", "", **{"X-Inferd-Model-Version": "1"})
                for i in range(20)
            ),
        )
        text = await metrics(http, server)
    assert all(status == 200 for status, _, _ in unversioned + pinned)
    shares = Counter(version for _, version, _ in unversioned)
    assert set(shares) == {"1", "2"}
    assert 0.15 <= shares["2"] / 300 <= 0.45  # binomial(300, 0.3): sigma 0.026, so beyond 5 sigma
    assert {version for _, version, _ in pinned} == {"1"}
    assert 'inferd_traffic_weight{model="canary",version="2"} 0.3' in text


async def test_ab_by_header_gives_one_user_one_version_every_time(server: ServerProc) -> None:
    users = [f"user-{i}" for i in range(16)]
    async with aiohttp.ClientSession() as http:
        seen: dict[str, set[str | None]] = {u: set() for u in users}
        for round_ in range(3):
            answers = await asyncio.gather(
                *(infer(http, server, "ab", f"{u}-{round_}", **{"X-User": u}) for u in users)
            )
            for user, (status, version, _) in zip(users, answers, strict=True):
                assert status == 200
                seen[user].add(version)
    assert all(len(versions) == 1 for versions in seen.values())
    assert set().union(*seen.values()) == {"1", "2"}  # 16 users, both arms (the hash is fixed)


async def test_a_failing_canary_is_rolled_back_and_unversioned_traffic_returns_to_v1(
    server: ServerProc,
) -> None:
    async with aiohttp.ClientSession() as http:
        failures, rolled_back = 0, False
        for batch in range(100):  # bounded by count: the judge looks at most once a second
            answers = await asyncio.gather(
                *(infer(http, server, "failing", f"x{batch}-{i}") for i in range(8))
            )
            failures += sum(status != 200 for status, _, _ in answers)
            if 'inferd_traffic_rollbacks_total{model="failing"} 1.0' in await metrics(http, server):
                rolled_back = True
                break
            await asyncio.sleep(0.2)
        assert rolled_back, server.log()
        assert failures > 0
        after = await asyncio.gather(*(infer(http, server, "failing", f"xafter{i}") for i in range(60)))
        text = await metrics(http, server)
        traffic = await admin(http, server, "/admin/traffic")
    assert {(status, version) for status, version, _ in after} == {(200, "1")}
    (event,) = [e for e in traffic["history"] if e["model"] == "failing"]
    assert event["event"] == "rolled_back" and event["version"] == 2
    assert "canary error ratio" in event["reason"] and event["at"] > 0
    split = next(s for s in traffic["splits"] if s["model"] == "failing")
    assert split["state"] == "rolled_back" and split["weights"] == {"1": 1.0, "2": 0.0}
    assert 'inferd_traffic_weight{model="failing",version="2"} 0.0' in text
    assert 'inferd_traffic_weight{model="failing",version="1"} 1.0' in text
    log = server.log()
    assert "canary 'failing' version 2 rolled back to weight 0: canary error ratio" in log


def test_a_traffic_version_that_is_not_served_stops_serve_before_start(tmp_path: Path) -> None:
    toml = COMMON + "[versions.2]\n\n[traffic]\ncanary = { version = 3, weight = 0.1 }\n"
    repo = write_repo(tmp_path, {"sim": toml})
    done = subprocess.run(
        [sys.executable, "-m", "inferd.cli.main", "serve", "--model-repo", str(repo), "--port", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2
    assert "canary version 3 is not served (served versions: [1, 2])" in done.stderr
