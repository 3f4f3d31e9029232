"""Response cache metrics: requests of cache-enabled models by result, and what the store holds."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

RESULTS = ("hit", "miss", "bypass")


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "inferd_cache_requests_total",
            "Requests of cache-enabled models by cache result (hit, miss, bypass: not cacheable).",
            ["model", "result"],
            registry=registry,
        )
        self.entries = Gauge(
            "inferd_cache_entries", "Answers held by the response cache.", ["model"], registry=registry
        )
        self.bytes = Gauge(
            "inferd_cache_bytes", "Bytes of answers held by the response cache.", ["model"], registry=registry
        )
        self._requests: dict[tuple[str, str], Counter] = {}

    def request(self, model: str, result: str) -> None:
        child = self._requests.get((model, result))
        if child is None:
            child = self._requests[(model, result)] = self.requests.labels(model, result)
        child.inc()

    def held(self, model: str, entries: int, nbytes: int) -> None:
        self.entries.labels(model).set(entries)
        self.bytes.labels(model).set(nbytes)
