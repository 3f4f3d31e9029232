"""Where the response cache (gateway/cache.py) meets the routes.

Routes that can be cached (OIP infer, /v1/embeddings) call `CacheHook.answer` at the model-call level,
after decoding and before queueing, with the canonical request and a `compute` that queues the work.
The `CacheResult` layer of the middleware chain then labels every response of a cache-enabled model
with `X-Inferd-Cache: hit | miss | bypass` and counts it; "bypass" is anything not answered through the
cache: errors (a failed answer is never stored), and routes or requests that cannot be cached.

The tenant in the key is the caller's authenticated tenant (`call.tenant`, set by the Auth layer; ""
for every anonymous caller, as without tenants), so one tenant's answers never serve another. One store per served model version;
when a version stops being served its store is emptied and dropped. A model with
`cache.store = "redis"` keeps its answers in the Redis of `[gateway] redis_url`, shared by every front
end (gateway/redis_cache.py); its store errors answer "bypass" and count in
inferd_cache_store_errors_total.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from inferd.api.asgi import Response
from inferd.clock import Clock
from inferd.config.cache import CacheConfig
from inferd.core.call import Call, Handler
from inferd.errors import DeadlineExceeded
from inferd.gateway.cache import Lookup, ResponseCache, request_key
from inferd.gateway.redis_cache import RedisCacheClient, RedisResponseCache, check_cache_stores, redis_url_for
from inferd.observability.cache_metrics import CacheMetrics
from inferd.runtime.contract import Runtime
from inferd.runtime.registry import ModelRegistry

V = TypeVar("V")
NOTE = "cache"
"""call.notes key of the cache result of a call ("hit" or "miss"; absent: bypass)."""
RESULTS = ("hit", "miss", "bypass")


@dataclass(frozen=True, slots=True)
class ModelCacheStatistics:
    """One cache-enabled model (all its served versions): its responses by cache result, as
    X-Inferd-Cache labelled them, and what its stores hold."""

    model: str
    hits: int
    misses: int
    bypass: int
    """Responses not answered through the cache: errors and requests that cannot be cached."""
    entries: int
    bytes: int
    coalesced: int
    """Hits that waited for an identical request in flight."""
    evictions: int
    expirations: int
    store_errors: int = 0
    """Errors of the shared store (cache.store = "redis"); each such request was answered "bypass"."""

    @property
    def hit_ratio(self) -> float | None:
        """Hits over hits and misses (bypassed responses never asked the cache); None before any."""
        asked = self.hits + self.misses
        return self.hits / asked if asked else None


class CacheHook:
    def __init__(
        self,
        registry: ModelRegistry,
        metrics: CacheMetrics,
        clock: Clock,
        redis_url: str | None = None,
        redis_timeout_ms: int = 250,
    ) -> None:
        """`redis_url` (`[gateway] redis_url`): where models with cache.store = "redis" keep their
        answers; such a model without it is a ConfigError."""
        check_cache_stores((rt.config for rt in registry), redis_url)
        self.registry = registry
        self.metrics = metrics
        self.clock = clock
        self._redis_url, self._redis_timeout_ms = redis_url, redis_timeout_ms
        self._redis: RedisCacheClient | None = None
        self._stores: dict[tuple[str, int], ResponseCache[Any]] = {}
        self._served: dict[str, list[int]] = {}
        self._results: dict[str, dict[str, int]] = {}
        """Responses by cache result, per model (the served models: a bounded set)."""
        metrics.watch(self.statistics)

    async def answer(
        self, call: Call, rt: Runtime, canonical: Any, compute: Callable[[], Awaitable[tuple[V, int]]]
    ) -> tuple[V, Lookup]:
        """`compute()`'s answer (value, size in bytes), or the cached answer of an identical request of
        the same tenant to the same model version, recorded on the call for `CacheResult`. A caller that
        waits for an identical request in flight is bounded by its own deadline (`call.deadline`: 504)."""
        store = self.store_for(rt)
        tenant, deadline = call.tenant, call.deadline  # anonymous callers share ""
        key = request_key("" if tenant.anonymous else tenant.name, rt.name, rt.version, canonical)
        try:
            async with asyncio.timeout(None if deadline is None else max(0.0, deadline - self.clock.now())):
                value, lookup = await store.get_or_compute(key, compute)
        except TimeoutError:
            raise DeadlineExceeded(
                f"deadline passed while waiting for an identical request to model '{rt.name}'"
            ) from None
        call.notes[NOTE] = lookup
        return value, lookup

    def store_for(self, rt: Runtime) -> ResponseCache[Any]:
        """The store of `rt`'s version (created on first use); stores of versions no longer served are
        emptied and dropped first, so a rollout frees the old version's answers."""
        served = self.registry.versions(rt.name)
        if self._served.get(rt.name) != served:
            self._served[rt.name] = served
            for name, version in [k for k in self._stores if k[0] == rt.name and k[1] not in served]:
                self._stores.pop((name, version)).clear()
        store = self._stores.get((rt.name, rt.version))
        if store is None or store.config is not rt.config.cache:
            store = self._stores[(rt.name, rt.version)] = self._new_store(rt)
        return store

    def _new_store(self, rt: Runtime) -> ResponseCache[Any]:
        config = rt.config.cache
        if config.store == "memory":
            return ResponseCache(config, self.clock)
        if self._redis is None:
            url = redis_url_for(rt.name, self._redis_url)
            self._redis = RedisCacheClient(url, self.clock, self._redis_timeout_ms)
        model = rt.name
        return RedisResponseCache(
            config, self.clock, self._redis, (model, rt.version), lambda _: self.metrics.store_error(model)
        )

    async def close(self) -> None:
        """Close the Redis connection, if one was opened (server shutdown)."""
        if self._redis is not None:
            await self._redis.close()

    def reconfigure(self, model: str, version: int, config: CacheConfig) -> int:
        """A reload changed a served version's cache setting: its store takes the new ttl and bounds
        (`ResponseCache.reconfigure`), or is emptied and dropped when caching is off. Returns how many
        answers were dropped."""
        store = self._stores.get((model, version))
        if store is None:
            return 0
        if not config.enabled or config.store != store.config.store:  # a new store is made on next use
            del self._stores[(model, version)]
            dropped = store.statistics().entries
            store.clear()
            return dropped
        return store.reconfigure(config)

    def count(self, model: str, result: str) -> None:
        """One response of a cache-enabled model, by its cache result (hit, miss or bypass)."""
        counts = self._results.get(model)
        if counts is None:
            counts = self._results[model] = dict.fromkeys(RESULTS, 0)
        counts[result] += 1
        self.metrics.request(model, result)

    def statistics(self) -> tuple[ModelCacheStatistics, ...]:
        """Every model that answered through the cache or holds a store, by name."""
        models = sorted({name for name, _ in self._stores} | set(self._results))
        return tuple(self._model_statistics(model) for model in models)

    def _model_statistics(self, model: str) -> ModelCacheStatistics:
        stores = [s.statistics() for (name, _), s in self._stores.items() if name == model]
        counts = self._results.get(model, dict.fromkeys(RESULTS, 0))
        return ModelCacheStatistics(
            model=model,
            hits=counts["hit"],
            misses=counts["miss"],
            bypass=counts["bypass"],
            entries=sum(s.entries for s in stores),
            bytes=sum(s.bytes for s in stores),
            coalesced=sum(s.coalesced for s in stores),
            evictions=sum(s.evictions for s in stores),
            expirations=sum(s.expirations for s in stores),
            store_errors=sum(s.store_errors for s in stores),
        )


class CacheResult:
    """X-Inferd-Cache on every response of a cache-enabled model (errors included: "bypass"), counted
    by result (`CacheHook.count`: its statistics and inferd_cache_requests_total)."""

    def __init__(self, inner: Handler, hook: CacheHook) -> None:
        self.inner = inner
        self.hook = hook

    async def __call__(self, call: Call, request: object) -> Response:
        response = await self.inner(call, request)
        rt = call.runtime
        if rt is not None and rt.config.cache.enabled:
            result = call.notes.get(NOTE, "bypass")
            response.headers.append((b"x-inferd-cache", result.encode()))
            self.hook.count(rt.name, result)
        return response
