"""The response cache on a fake clock: TTL, LRU eviction by entries and by bytes, single-flight,
versions and tenants in the key, and the canonical request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from inferd.api.asgi import HttpResponse
from inferd.api.cache_hook import CacheHook, CacheResult
from inferd.clock import FakeClock
from inferd.config import ModelConfig, TensorSpec
from inferd.config.cache import CacheConfig
from inferd.config.tenants import TenantConfig
from inferd.core.call import Call
from inferd.core.disconnect import STAYING
from inferd.core.tenant import Tenant
from inferd.errors import DeadlineExceeded, ModelError
from inferd.gateway.cache import CacheKey, ResponseCache, request_key
from inferd.observability.cache_metrics import CacheMetrics
from inferd.runtime.registry import ModelRegistry


def key(name: str, tenant: str = "", version: int = 1) -> CacheKey:
    return request_key(tenant, "sim", version, name)


def make(clock: FakeClock, **settings: float) -> ResponseCache[str]:
    return ResponseCache(CacheConfig(enabled=True, **settings), clock)  # type: ignore[arg-type]


def test_entry_expires_after_ttl() -> None:
    clock = FakeClock()
    cache = make(clock, ttl_s=60)
    cache.store(key("a"), "A", 10)
    clock.advance(59.9)
    assert cache.lookup(key("a")) == "A"
    clock.advance(0.1)
    assert cache.lookup(key("a")) is None
    stats = cache.statistics()
    assert (stats.entries, stats.bytes, stats.expirations) == (0, 0, 1)


def test_lookup_refreshes_recency_but_not_ttl() -> None:
    clock = FakeClock()
    cache = make(clock, ttl_s=10)
    cache.store(key("a"), "A", 1)
    clock.advance(9)
    assert cache.lookup(key("a")) == "A"
    clock.advance(1)
    assert cache.lookup(key("a")) is None


def test_least_recently_used_goes_first_past_max_entries() -> None:
    cache = make(FakeClock(), max_entries=2)
    cache.store(key("a"), "A", 1)
    cache.store(key("b"), "B", 1)
    assert cache.lookup(key("a")) == "A"  # b is now the least recently used
    cache.store(key("c"), "C", 1)
    assert cache.lookup(key("b")) is None
    assert (cache.lookup(key("a")), cache.lookup(key("c"))) == ("A", "C")
    assert cache.statistics().evictions == 1


def test_bytes_bound_evicts_until_it_fits() -> None:
    cache = make(FakeClock(), max_bytes=1024)
    cache.store(key("a"), "A", 400)
    cache.store(key("b"), "B", 400)
    cache.store(key("c"), "C", 500)  # 1300 > 1024: a goes; 900 fits
    assert cache.lookup(key("a")) is None
    assert cache.statistics().bytes == 900
    assert not cache.store(key("huge"), "H", 1025)  # larger than the whole store: never kept
    assert cache.lookup(key("huge")) is None
    assert cache.statistics().bytes == 900


def test_storing_a_key_again_replaces_its_size() -> None:
    cache = make(FakeClock())
    cache.store(key("a"), "A", 100)
    cache.store(key("a"), "A2", 30)
    assert cache.lookup(key("a")) == "A2"
    assert (cache.statistics().entries, cache.statistics().bytes) == (1, 30)


def test_keys_of_other_versions_and_tenants_miss() -> None:
    cache = make(FakeClock())
    cache.store(key("a", tenant="t1", version=1), "A", 1)
    assert cache.lookup(key("a", tenant="t1", version=2)) is None
    assert cache.lookup(key("a", tenant="t2", version=1)) is None
    assert cache.lookup(key("a", tenant="", version=1)) is None
    assert cache.lookup(key("a", tenant="t1", version=1)) == "A"


def test_drop_versions_forgets_the_old_versions_answers() -> None:
    cache = make(FakeClock())
    cache.store(key("a", version=1), "A1", 5)
    cache.store(key("a", version=2), "A2", 7)
    assert cache.drop_versions(frozenset({2})) == 1
    assert cache.lookup(key("a", version=1)) is None
    assert cache.lookup(key("a", version=2)) == "A2"
    assert cache.statistics().bytes == 7


def test_canonical_key_ignores_how_arrays_were_built_but_not_their_values() -> None:
    a = np.asarray([1.0, 2.0], dtype=np.float32)
    b = np.frombuffer(a.tobytes(), dtype=np.float32)  # same values, another origin (binary tensors)
    assert request_key("", "m", 1, [a]) == request_key("", "m", 1, [b])
    assert request_key("", "m", 1, [a]) != request_key("", "m", 1, [a.astype(np.float64)])
    assert request_key("", "m", 1, [a]) != request_key("", "m", 1, [a[::-1].copy()])
    texts = np.empty(2, dtype=object)
    texts[:] = [b"x", b"y"]
    other = np.empty(2, dtype=object)
    other[:] = [b"x", b"z"]
    assert request_key("", "m", 1, [texts]) != request_key("", "m", 1, [other])


class Model:
    """A computation the test releases by hand, counting its runs."""

    def __init__(self) -> None:
        self.runs = 0
        self.release = asyncio.Event()
        self.fail_with: BaseException | None = None

    async def __call__(self) -> tuple[str, int]:
        self.runs += 1
        await self.release.wait()
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        return f"answer{self.runs}", 10


async def settle_tasks() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_identical_concurrent_requests_compute_once() -> None:
    cache = make(FakeClock())
    model = Model()
    tasks = [asyncio.create_task(cache.get_or_compute(key("a"), model)) for _ in range(3)]
    await settle_tasks()
    assert cache.statistics().in_flight == 1
    model.release.set()
    results = await asyncio.gather(*tasks)
    assert model.runs == 1
    assert results == [("answer1", "miss"), ("answer1", "hit"), ("answer1", "hit")]
    stats = cache.statistics()
    assert (stats.misses, stats.hits, stats.coalesced, stats.in_flight) == (1, 2, 2, 0)
    assert await cache.get_or_compute(key("a"), model) == ("answer1", "hit")


async def test_leader_error_is_not_cached_and_followers_try_again() -> None:
    cache = make(FakeClock())
    model = Model()
    model.fail_with = ModelError("boom")
    leader = asyncio.create_task(cache.get_or_compute(key("a"), model))
    await settle_tasks()
    follower = asyncio.create_task(cache.get_or_compute(key("a"), model))
    await settle_tasks()
    model.release.set()
    with pytest.raises(ModelError):
        await leader
    assert await follower == ("answer2", "miss")  # the follower led a computation of its own
    assert model.runs == 2
    assert cache.lookup(key("a")) == "answer2"


async def test_cancelled_leader_hands_over_to_a_follower() -> None:
    cache = make(FakeClock())
    model = Model()
    leader = asyncio.create_task(cache.get_or_compute(key("a"), model))
    await settle_tasks()
    follower = asyncio.create_task(cache.get_or_compute(key("a"), model))
    await settle_tasks()
    leader.cancel()
    await settle_tasks()
    model.release.set()
    assert await follower == ("answer2", "miss")
    assert leader.cancelled()
    assert cache.statistics().in_flight == 0


async def test_cancelled_follower_leaves_the_leader_running() -> None:
    cache = make(FakeClock())
    model = Model()
    leader = asyncio.create_task(cache.get_or_compute(key("a"), model))
    await settle_tasks()
    follower = asyncio.create_task(cache.get_or_compute(key("a"), model))
    await settle_tasks()
    follower.cancel()
    await settle_tasks()
    model.release.set()
    assert await leader == ("answer1", "miss")
    assert follower.cancelled()


# ---- the routes' entry point (api/cache_hook.py): tenants, rollouts, deadlines ------------------------


@dataclass
class FakeRuntime:
    name: str
    version: int
    config: ModelConfig


def sim_config(version: int = 1) -> ModelConfig:
    return ModelConfig(
        name="sim",
        version=version,
        implementation="inferd.models.sim:SimModel",
        inputs=[TensorSpec(name="x", datatype="FP32", shape=(1,))],
        outputs=[TensorSpec(name="y", datatype="FP32", shape=(1,))],
        cache=CacheConfig(enabled=True),
    )


def bare_call(deadline: float | None = None) -> Call:
    """A call to sim as an edge reads it: anonymous, a caller that never leaves."""
    path = "/v2/models/sim/infer"
    return Call(lambda exc, status: b"", STAYING, route=path, method="POST", target=path, deadline=deadline)


def call_of(tenant: str | None, deadline: float | None = None) -> Call:
    """A call to sim, of `tenant` (None: anonymous) as the Auth layer names it."""
    call = bare_call(deadline)
    if tenant is not None:
        call.tenant = Tenant(tenant, TenantConfig())
    return call


class Hooked:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.registry = ModelRegistry()
        self.prometheus = CollectorRegistry()
        self.hook = CacheHook(self.registry, CacheMetrics(self.prometheus), self.clock)
        self.runs = 0

    def serve(self, version: int) -> FakeRuntime:
        rt = FakeRuntime("sim", version, sim_config(version))
        self.registry.add(rt)  # type: ignore[arg-type]
        return rt

    async def ask(self, rt: FakeRuntime, tenant: str | None, inputs: str = "x") -> tuple[str, str]:
        async def compute() -> tuple[str, int]:
            self.runs += 1
            return f"{inputs} run {self.runs}", 100

        return await self.hook.answer(call_of(tenant), rt, inputs, compute)  # type: ignore[arg-type]

    def held(self, what: str) -> float | None:
        return self.prometheus.get_sample_value(f"inferd_cache_{what}", {"model": "sim"})


async def test_an_answer_never_serves_another_tenant() -> None:
    h = Hooked()
    rt = h.serve(1)
    assert await h.ask(rt, "acme") == ("x run 1", "miss")
    assert await h.ask(rt, "acme") == ("x run 1", "hit")
    assert await h.ask(rt, "globex") == ("x run 2", "miss")
    assert await h.ask(rt, None) == ("x run 3", "miss")  # anonymous callers share one namespace
    assert await h.ask(rt, None) == ("x run 3", "hit")
    assert await h.ask(rt, "globex", inputs="other") == ("other run 4", "miss")


async def test_hook_records_the_result_on_the_call() -> None:
    h = Hooked()
    rt = h.serve(1)
    call = call_of(None)

    async def compute() -> tuple[str, int]:
        return "y", 1

    await h.hook.answer(call, rt, "x", compute)  # type: ignore[arg-type]
    assert call.notes["cache"] == "miss"


async def test_rollout_drops_the_old_versions_answers() -> None:
    h = Hooked()
    v1 = h.serve(1)
    await h.ask(v1, None)
    await h.ask(v1, None, inputs="y")
    assert (h.held("entries"), h.held("bytes")) == (2, 200)
    v2 = h.serve(2)
    assert await h.ask(v2, None) == ("x run 3", "miss")  # the version is part of the key
    h.registry.remove("sim", 1)
    assert await h.ask(v2, None) == ("x run 3", "hit")
    assert (h.held("entries"), h.held("bytes")) == (1, 100)


async def test_a_waiting_caller_is_bounded_by_its_own_deadline() -> None:
    h = Hooked()
    rt = h.serve(1)
    release = asyncio.Event()

    async def slow() -> tuple[str, int]:
        await release.wait()
        return "late", 1

    leader = asyncio.create_task(h.hook.answer(call_of(None), rt, "x", slow))  # type: ignore[arg-type]
    await settle_tasks()
    with pytest.raises(DeadlineExceeded):
        await h.hook.answer(call_of(None, deadline=h.clock.now()), rt, "x", slow)  # type: ignore[arg-type]
    release.set()
    assert await leader == ("late", "miss")


async def test_result_layer_labels_only_cache_enabled_models() -> None:
    prometheus = CollectorRegistry()
    cached, plain = FakeRuntime("sim", 1, sim_config()), FakeRuntime("plain", 1, sim_config())
    plain.config = plain.config.model_copy(update={"cache": CacheConfig()})

    async def handler(call: Call, request: object) -> HttpResponse:
        call.runtime = call.notes.pop("serve")
        return HttpResponse(content_type=None)

    layer = CacheResult(handler, CacheHook(ModelRegistry(), CacheMetrics(prometheus), FakeClock()))

    async def header(rt: FakeRuntime, note: str | None) -> bytes | None:
        call = bare_call()
        call.notes["serve"] = rt
        if note is not None:
            call.notes["cache"] = note
        return (await layer(call, None)).header(b"x-inferd-cache")

    assert await header(plain, None) is None
    assert await header(cached, None) == b"bypass"  # nothing answered through the cache
    assert await header(cached, "hit") == b"hit"
    counted = {
        r: prometheus.get_sample_value("inferd_cache_requests_total", {"model": "sim", "result": r})
        for r in ("hit", "bypass")
    }
    assert counted == {"hit": 1.0, "bypass": 1.0}
    assert (
        prometheus.get_sample_value("inferd_cache_requests_total", {"model": "plain", "result": "bypass"})
        is None
    )
