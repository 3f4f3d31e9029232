"""RedisResponseCache against a real redis-server (tests/redis_server.py): two stores on one Redis act as
two front ends; the per-version bounds hold across them, answers come back as they went in, keys carry
no raw request, and an unreachable Redis answers "bypass" without asking again for RETRY_AFTER_S."""

from __future__ import annotations

import re
import signal
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from inferd.clock import FakeClock
from inferd.config import ConfigError, ModelConfig, TensorSpec
from inferd.config.cache import CacheConfig
from inferd.gateway.cache import request_key
from inferd.gateway.redis_cache import RETRY_AFTER_S, RedisCacheClient, RedisResponseCache, check_cache_stores
from tests.conftest import free_port
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)


class FrontEnd:
    """One front end's store of model "sim" v1, and the store errors it heard of."""

    def __init__(self, url: str, clock: FakeClock, timeout_ms: int = 1000, **settings: Any) -> None:
        self.client = RedisCacheClient(url, clock, timeout_ms)
        self.errors: list[BaseException] = []
        config = CacheConfig(enabled=True, store="redis", **settings)
        self.store: RedisResponseCache[Any] = RedisResponseCache(
            config, clock, self.client, ("sim", 1), self.errors.append
        )
        self.runs = 0

    async def ask(self, text: str, tenant: str = "acme") -> tuple[Any, str]:
        async def compute() -> tuple[Any, int]:
            self.runs += 1
            return f"{text}:{self.runs}", 0

        return await self.store.get_or_compute(request_key(tenant, "sim", 1, text), compute)


@pytest.fixture
async def inspect(redis_server: RedisServer) -> AsyncIterator[Any]:  # noqa: F811
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def entries(client: Any) -> list[bytes]:
    return sorted(k for k in await client.keys("inferd:cache:*") if k.count(b":") == 5)


async def test_two_front_ends_share_answers_and_one_bound_on_entries(
    redis_server: RedisServer,  # noqa: F811
    inspect: Any,
) -> None:
    clock = FakeClock()
    one, two = (
        FrontEnd(redis_server.url, clock, max_entries=3),
        FrontEnd(redis_server.url, clock, max_entries=3),
    )
    assert await one.ask("a") == ("a:1", "miss")
    assert await two.ask("a") == ("a:1", "hit")
    assert await two.ask("a", tenant="globex") == ("a:1", "miss")  # globex's own run 1 on `two`
    await one.ask("b")
    assert len(await entries(inspect)) == 3
    assert await one.ask("a") == ("a:1", "hit")  # acme's "a" is now the most recently used
    await two.ask("c")  # past max_entries: the least recently used (globex's "a") goes
    assert await one.ask("a", tenant="globex") == ("a:3", "miss")
    held = await entries(inspect)
    assert len(held) == 3
    assert all(re.fullmatch(rb"inferd:cache:\{sim:v1\}:(acme|globex):[0-9a-f]{64}", k) for k in held), held
    assert one.store.statistics().entries == 3 and one.store.statistics().evictions >= 1
    assert one.errors == two.errors == []
    for front in (one, two):
        await front.client.close()


async def test_bytes_bound_and_ttl_are_redis_side(redis_server: RedisServer, inspect: Any) -> None:  # noqa: F811
    clock = FakeClock()
    front = FrontEnd(redis_server.url, clock, max_bytes=2048, ttl_s=30)
    big = "x" * 900
    for text in ("p", "q", "r"):
        await front.ask(big + text)
    held = await entries(inspect)
    assert len(held) == 2  # two answers of ~900 bytes fit in 2048, three do not
    assert int(await inspect.get(b"inferd:cache:{sim:v1}:bytes")) <= 2048
    assert 29_000 < await inspect.pttl(held[0]) <= 30_000
    await inspect.delete(*held)  # as if they expired: a read forgets them and misses
    assert (await front.ask(big + "q"))[1] == "miss"
    await front.client.close()


async def test_answers_come_back_as_they_went_in(redis_server: RedisServer) -> None:  # noqa: F811
    clock = FakeClock()
    one, two = FrontEnd(redis_server.url, clock), FrontEnd(redis_server.url, clock)
    rows = [{"y": np.arange(6, dtype=np.float32).reshape(2, 3), "t": np.array([b"a", b"bc"], dtype=object)}]
    answer = (1, rows, {"batch_id": 7, "compute_ms": 1.5})
    key = request_key("", "sim", 1, "rows")

    async def compute() -> tuple[Any, int]:
        return answer, 0

    assert (await one.store.get_or_compute(key, compute))[1] == "miss"
    (version, got, record), lookup = await two.store.get_or_compute(key, compute)
    assert lookup == "hit" and version == 1 and record == answer[2]
    assert got[0]["y"].dtype == np.float32 and np.array_equal(got[0]["y"], rows[0]["y"])
    assert got[0]["t"].dtype == object and got[0]["t"].tolist() == [b"a", b"bc"]
    for front in (one, two):
        await front.client.close()


async def test_an_unreachable_redis_is_bypassed_and_left_alone_for_a_while() -> None:
    clock = FakeClock()
    front = FrontEnd(f"redis://127.0.0.1:{free_port()}/0", clock)  # nobody listens there
    assert await front.ask("a") == ("a:1", "bypass")
    assert len(front.errors) == 1 and not front.client.health.up
    assert await front.ask("a") == ("a:2", "bypass")  # not asked again yet: no new error
    assert len(front.errors) == 1
    clock.advance(RETRY_AFTER_S)
    assert await front.ask("a") == ("a:3", "bypass")
    assert len(front.errors) == 2 and front.store.statistics().store_errors == 2
    await front.client.close()


def test_a_redis_store_without_redis_url_is_refused_naming_the_fix() -> None:
    model = ModelConfig(
        name="sim",
        implementation="inferd.models.sim:SimModel",
        inputs=[TensorSpec(name="x", datatype="FP32", shape=(1,))],
        outputs=[TensorSpec(name="y", datatype="FP32", shape=(1,))],
        cache=CacheConfig(enabled=True, store="redis"),
    )
    with pytest.raises(ConfigError, match=r"\[gateway\] redis_url"):
        check_cache_stores([model], None)
    check_cache_stores([model], "redis://127.0.0.1:6379/0")
    check_cache_stores([model.model_copy(update={"cache": CacheConfig(store="redis")})], None)  # disabled


async def test_a_hung_redis_times_out_once_then_is_bypassed_until_it_answers_again(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    clock = FakeClock()
    front = FrontEnd(redis_server.url, clock, timeout_ms=200)
    assert await front.ask("a") == ("a:1", "miss")
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        assert await front.ask("a") == ("a:2", "bypass")  # one timeout
        assert await front.ask("a") == ("a:3", "bypass")  # left alone: no second timeout
        assert len(front.errors) == 1 and "Timeout" in type(front.errors[0]).__name__
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    clock.advance(RETRY_AFTER_S)
    assert await front.ask("a") == ("a:1", "hit")
    assert front.client.health.up
    await front.client.close()
