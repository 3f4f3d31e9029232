"""The Redis quota store against a real redis-server (tests/redis_server.py): three front-end processes
hammering one tenant's quotas at once must not overshoot any limit together, and a Redis that is down
or hung is answered as `on_store_error` says."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from inferd.config.tenants import TenantConfig
from inferd.core.tenant import Tenant
from inferd.errors import Overloaded
from inferd.gateway.quota_store import QuotaSettings, TenantQuotas
from inferd.gateway.redis_store import RedisStore, open_quota_store
from tests.conftest import ROOT, free_port
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)

TENANT = Tenant(
    "acme", TenantConfig(requests_per_s=200.0, burst=20, tokens_per_min=120_000, max_concurrency=3)
)
MAX_TOKENS = 2000
PROCESSES = 3
TASKS_PER_PROCESS = 4
HAMMER_S = 3.0


async def _hammer(url: str, seed: int, start_at: float) -> dict:
    rng = random.Random(seed)
    store = RedisStore(url, timeout_ms=5000)
    quotas = TenantQuotas(store, QuotaSettings(redis_url=url, on_store_error="closed"))
    grants: list[tuple[float, int, int, float, float]] = []
    refusals: list[tuple[float, float, list[str]]] = []
    await asyncio.sleep(max(0.0, start_at - time.time()))
    deadline = time.monotonic() + HAMMER_S

    async def front_end_task() -> None:
        while time.monotonic() < deadline:
            tokens = rng.randint(50, MAX_TOKENS)
            decision = await quotas.admit(TENANT, tokens)
            if not decision.allowed:
                assert decision.retry_after_s is not None and decision.retry_after_s > 0
                refusals.append((decision.at_s, decision.retry_after_s, list(decision.refused_by)))
                await asyncio.sleep(min(decision.retry_after_s, 0.02))
                continue
            assert decision.grant is not None
            holding_from = time.time()  # the lease is held from before this to after holding_to
            used = rng.randint(0, tokens)
            await asyncio.sleep(rng.uniform(0.0, 0.01))
            holding_to = time.time()
            await quotas.release(TENANT, decision.grant, used_tokens=used)
            grants.append((decision.at_s, tokens, used, holding_from, holding_to))

    async with asyncio.TaskGroup() as tg:
        for _ in range(TASKS_PER_PROCESS):
            tg.create_task(front_end_task())
    await store.close()
    return {"grants": grants, "refusals": refusals, "conflicts": store.conflicts}


def hammer(url: str, seed: int, start_at: float) -> None:
    """One front end (run in its own process): admit, hold, release, for HAMMER_S seconds."""
    print(json.dumps(asyncio.run(_hammer(url, seed, start_at))))


def run_front_ends(url: str) -> list[dict]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    start_at = time.time() + 2.0  # all three start together, once imported
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import hammer; hammer({url!r}, {seed}, {start_at})"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=Path(ROOT),
        )
        for seed in range(PROCESSES)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"front end exited with {proc.returncode}: {err.decode()[-3000:]}"
        results.append(json.loads(out))
    return results


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def test_three_front_ends_together_never_overshoot_a_tenants_limits(redis_server: RedisServer) -> None:  # noqa: F811
    results = run_front_ends(redis_server.url)
    grants = sorted(g for r in results for g in r["grants"])
    limits = TENANT.config
    assert limits.tokens_per_min is not None and limits.requests_per_s is not None and limits.burst
    at_us = [round(at * 1e6) for at, *_ in grants]
    for i, start in enumerate(at_us):  # every 60 s window that starts at a grant
        net = sum(
            used for (_, _, used, _, _), t in zip(grants[i:], at_us[i:], strict=True) if t < start + 60e6
        )
        assert net <= limits.tokens_per_min + MAX_TOKENS
    interval_us = round(1e6 / limits.requests_per_s)
    for i in range(len(at_us)):
        for j in range(i, len(at_us)):
            assert j - i + 1 <= limits.burst + (at_us[j] - at_us[i]) / interval_us
    assert limits.max_concurrency is not None
    assert max_overlap([(g[3], g[4]) for g in grants]) <= limits.max_concurrency
    # and the limits were really contended: every front end got in, and the tokens limit was reached
    assert all(r["grants"] for r in results)
    assert any("tokens" in by for r in results for _, _, by in r["refusals"])
    assert sum(r["conflicts"] for r in results) > 0, "the front ends raced for the same state"


async def test_redis_down_fails_open_then_enforces_again(
    redis_server: RedisServer,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    tenant = Tenant("solo", TenantConfig(requests_per_s=1.0, burst=1))
    store = open_quota_store(QuotaSettings(redis_url=redis_server.url, redis_timeout_ms=250))
    quotas = TenantQuotas(store, QuotaSettings(redis_url=redis_server.url, on_store_error="open"))
    try:
        with caplog.at_level(logging.WARNING, logger="inferd.gateway.quota_store"):
            assert (await quotas.admit(tenant)).allowed
            assert not (await quotas.admit(tenant)).allowed
            redis_server.stop()
            decision = await quotas.admit(tenant)
            assert decision.allowed and decision.headers() == {}
            assert "quota store unreachable" in caplog.text and "admitted without quotas" in caplog.text
            redis_server.start()  # same port, empty: the first request is admitted, the next is not
            assert (await quotas.admit(tenant)).allowed
            assert not (await quotas.admit(tenant)).allowed
            assert "reachable again" in caplog.text
        stats = quotas.statistics()
        assert (stats.admitted_without_store, stats.store_up) == (1, True)
    finally:
        await store.close()


async def test_unreachable_redis_fails_closed_with_overloaded() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    store = RedisStore(url, timeout_ms=250)
    quotas = TenantQuotas(store, QuotaSettings(redis_url=url, on_store_error="closed"))
    try:
        with pytest.raises(Overloaded, match="quota store unreachable") as err:
            await quotas.admit(Tenant("solo", TenantConfig(max_concurrency=1)))
        assert err.value.retryable
    finally:
        await store.close()


async def test_a_hung_redis_counts_as_down_after_the_timeout(redis_server: RedisServer) -> None:  # noqa: F811
    store = RedisStore(redis_server.url, timeout_ms=200)
    quotas = TenantQuotas(store, QuotaSettings(redis_url=redis_server.url, on_store_error="open"))
    tenant = Tenant("solo", TenantConfig(max_concurrency=1))
    assert redis_server.proc is not None
    try:
        assert (await quotas.admit(tenant)).allowed
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            async with asyncio.timeout(10):  # bounded: the store's own 200 ms timeout should end it
                decision = await quotas.admit(tenant)
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        assert decision.allowed and quotas.statistics().store_errors == 1
    finally:
        await store.close()


async def test_a_tenants_key_expires_once_its_state_no_longer_matters(redis_server: RedisServer) -> None:  # noqa: F811
    settings = QuotaSettings(redis_url=redis_server.url, lease_s=5.0)
    store = RedisStore(redis_server.url)
    quotas = TenantQuotas(store, settings)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        assert (await quotas.admit(Tenant("solo", TenantConfig(tokens_per_min=100)), tokens=10)).allowed
        ttl_ms = await client.pttl(f"{settings.key_prefix}solo")
        assert 61_000 < ttl_ms <= 62_000  # the tokens window (61 s) outlives the 5 s lease, plus 1 s
    finally:
        await client.aclose()
        await store.close()
