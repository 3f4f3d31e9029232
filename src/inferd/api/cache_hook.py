"""Where the response cache (gateway/cache.py) meets the routes.

Routes that can be cached (OIP infer, /v1/embeddings) call `CacheHook.answer` at the model-call level,
after decoding and before queueing, with the canonical request and a `compute` that queues the work.
The `CacheResult` layer of the middleware chain then labels every response of a cache-enabled model
with `X-Inferd-Cache: hit | miss | bypass` and counts it; "bypass" is anything not answered through the
cache: errors (a failed answer is never stored), and routes or requests that cannot be cached.

The tenant in the key is the caller's (`call.notes["tenant"]`, set by the Auth layer; "" without
tenants), so one tenant's answers never serve another. One store per served model version;
when a version stops being served its store is emptied and dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from inferd.api.asgi import HttpRequest
from inferd.api.middleware import Call, Handler, Response
from inferd.clock import Clock
from inferd.errors import DeadlineExceeded
from inferd.gateway.auth import tenant_of
from inferd.gateway.cache import Lookup, ResponseCache, request_key
from inferd.observability.cache_metrics import CacheMetrics
from inferd.runtime.contract import Runtime
from inferd.runtime.registry import ModelRegistry

V = TypeVar("V")
NOTE = "cache"
"""call.notes key of the cache result of a call ("hit" or "miss"; absent: bypass)."""


class CacheHook:
    def __init__(self, registry: ModelRegistry, metrics: CacheMetrics, clock: Clock) -> None:
        self.registry = registry
        self.metrics = metrics
        self.clock = clock
        self._stores: dict[tuple[str, int], ResponseCache[Any]] = {}
        self._served: dict[str, list[int]] = {}

    async def answer(
        self,
        request: HttpRequest,
        rt: Runtime,
        canonical: Any,
        compute: Callable[[], Awaitable[tuple[V, int]]],
        deadline: float | None,
    ) -> tuple[V, Lookup]:
        """`compute()`'s answer (value, size in bytes), or the cached answer of an identical request of
        the same tenant to the same model version. A caller that waits for an identical request in
        flight is bounded by its own deadline (504)."""
        call: Call | None = request.scope.get("inferd.call")
        store = self.store_for(rt)
        tenant = tenant_of(call)  # None: no tenants configured (anonymous callers share "")
        key = request_key(tenant.name if tenant else "", rt.name, rt.version, canonical)
        try:
            async with asyncio.timeout(None if deadline is None else max(0.0, deadline - self.clock.now())):
                value, lookup = await store.get_or_compute(key, compute)
        except TimeoutError:
            raise DeadlineExceeded(
                f"deadline passed while waiting for an identical request to model '{rt.name}'"
            ) from None
        finally:
            self._report(rt.name)
        if call is not None:
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
            store = self._stores[(rt.name, rt.version)] = ResponseCache(rt.config.cache, self.clock)
        return store

    def _report(self, model: str) -> None:
        stats = [s.statistics() for (name, _), s in self._stores.items() if name == model]
        self.metrics.held(model, sum(s.entries for s in stats), sum(s.bytes for s in stats))


class CacheResult:
    """X-Inferd-Cache on every response of a cache-enabled model (errors included: "bypass"), and
    inferd_cache_requests_total by result."""

    def __init__(self, inner: Handler, metrics: CacheMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def __call__(self, call: Call) -> Response:
        response = await self.inner(call)
        rt = call.runtime
        if rt is not None and rt.config.cache.enabled:
            result = call.notes.get(NOTE, "bypass")
            response.headers.append((b"x-inferd-cache", result.encode()))
            self.metrics.request(rt.name, result)
        return response
