"""The response cache in Redis end to end: two `inferd serve` front ends share one redis-server
(tests/redis_server.py) through `[gateway] redis_url` and `[models.sim.cache] store = "redis"`. An answer
computed on one front end is a hit on the other for the same tenant, never for another tenant; and with
Redis gone every request is still answered (bypass) while the store error counter moves."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferd.gateway.keys import key_digest, new_key
from tests.conftest import ROOT, ServerProc, start_server
from tests.redis_server import RedisServer

KEY_A, KEY_B = new_key(), new_key()


def config(redis_url: str) -> str:
    return f"""
[gateway]
redis_url = "{redis_url}"
redis_timeout_ms = 500

[models.sim.cache]
enabled = true
store = "redis"
ttl_s = 600

[tenants.alpha]
api_key_sha256 = ["{key_digest(KEY_A)}"]

[tenants.beta]
api_key_sha256 = ["{key_digest(KEY_B)}"]
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, ServerProc, ServerProc]]:
    """One redis-server and two front ends on it (the last test stops the redis-server)."""
    root = tmp_path_factory.mktemp("redis-cache")
    redis = RedisServer()
    redis.start()
    (root / "inferd.toml").write_text(config(redis.url))
    servers: list[ServerProc] = []
    try:
        for _ in range(2):
            servers.append(start_server(root, "--model", "sim", "--config", str(root / "inferd.toml")))
        yield redis, servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()
        redis.stop()


def infer(server: ServerProc, key: str, rid: str, text: str) -> tuple[int, dict[str, str], Any]:
    body = {"id": rid, "inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    req = urllib.request.Request(
        f"{server.url}/v2/models/sim/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-API-Key": key},
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            status, headers, out = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        status, headers, out = err.code, dict(err.headers), err.read()
    return status, {k.lower(): v for k, v in headers.items()}, json.loads(out)


def metric(server: ServerProc, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_miss_on_one_front_end_is_a_hit_on_the_other_for_the_same_tenant(
    shared: tuple[RedisServer, ServerProc, ServerProc],
) -> None:
    _, one, two = shared
    s1, h1, first = infer(one, KEY_A, "a-1", "shared")
    s2, h2, second = infer(two, KEY_A, "a-2", "shared")
    assert (s1, s2) == (200, 200), (first, second)
    assert (h1["x-inferd-cache"], h2["x-inferd-cache"]) == ("miss", "hit")
    assert second["id"] == "a-2" and second["outputs"] == first["outputs"]
    assert second["parameters"]["batch_id"] == first["parameters"]["batch_id"]  # computed once, on `one`
    assert metric(two, "inferd_cache_requests_total", 'model="sim",result="hit"') >= 1


def test_never_a_hit_across_tenants_even_through_the_shared_store(
    shared: tuple[RedisServer, ServerProc, ServerProc],
) -> None:
    _, one, two = shared
    _, ha, a = infer(one, KEY_A, "a", "tenant-bound")
    _, hb, b = infer(two, KEY_B, "b", "tenant-bound")
    _, hb2, b2 = infer(one, KEY_B, "b2", "tenant-bound")
    assert (ha["x-inferd-cache"], hb["x-inferd-cache"], hb2["x-inferd-cache"]) == ("miss", "miss", "hit")
    assert b["parameters"]["batch_id"] != a["parameters"]["batch_id"]  # beta's answer was computed anew
    assert b2["parameters"]["batch_id"] == b["parameters"]["batch_id"]  # and then served from beta's entry


def test_with_redis_gone_requests_are_answered_without_the_cache(
    shared: tuple[RedisServer, ServerProc, ServerProc],
) -> None:
    redis, one, two = shared
    before = metric(one, "inferd_cache_store_errors_total", 'model="sim"')
    redis.stop()  # SIGKILL: connections reset, then refused
    results = [infer(server, KEY_A, f"down-{i}", "shared") for i, server in enumerate((one, two, one))]
    assert [status for status, _, _ in results] == [200, 200, 200], results
    assert [h["x-inferd-cache"] for _, h, _ in results] == ["bypass"] * 3
    assert metric(one, "inferd_cache_store_errors_total", 'model="sim"') > before
    assert metric(one, "inferd_cache_requests_total", 'model="sim",result="bypass"') >= 2


def test_a_redis_store_without_redis_url_stops_the_start_naming_the_fix(tmp_path: Path) -> None:
    (tmp_path / "inferd.toml").write_text('[models.sim.cache]\nenabled = true\nstore = "redis"\n')
    args = ["serve", "--port", "0", "--model", "sim", "--config", str(tmp_path / "inferd.toml")]
    proc = subprocess.run(
        [sys.executable, "-m", "inferd.cli.main", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        "error: model 'sim' has cache.store = \"redis\" but [gateway] redis_url is not set: "
        'set [gateway] redis_url = "redis://HOST:6379/0", or use cache.store = "memory"'
    ), proc.stderr
