"""Response cache metrics: requests of cache-enabled models by result, errors of the shared store
(Redis), and what the stores hold."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

RESULTS = ("hit", "miss", "bypass")


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "inferd_cache_requests_total",
            "Requests of cache-enabled models by cache result (hit, miss, bypass: not cacheable).",
            ["model", "result"],
            registry=registry,
        )
        self.store_errors = Counter(
            "inferd_cache_store_errors_total",
            "Errors and timeouts of the shared response cache store (Redis), by model; the requests "
            "that met them were answered without the cache (bypass).",
            ["model"],
            registry=registry,
        )
        self._registry = registry
        self._requests: dict[tuple[str, str], Counter] = {}

    def request(self, model: str, result: str) -> None:
        child = self._requests.get((model, result))
        if child is None:
            child = self._requests[(model, result)] = self.requests.labels(model, result)
        child.inc()

    def store_error(self, model: str) -> None:
        self.store_errors.labels(model).inc()

    def watch(self, statistics: Callable[[], Iterable[Held]]) -> None:
        """What the stores hold (inferd_cache_entries, inferd_cache_bytes), read from `statistics` at
        scrape time: nothing on the request path."""
        self._registry.register(_HeldCollector(statistics))


class Held(Protocol):
    model: str
    entries: int
    bytes: int


class _HeldCollector(Collector):
    def __init__(self, statistics: Callable[[], Iterable[Held]]) -> None:
        self._statistics = statistics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        entries = GaugeMetricFamily(
            "inferd_cache_entries", "Answers held by the response cache.", labels=["model"]
        )
        held = GaugeMetricFamily(
            "inferd_cache_bytes", "Bytes of answers held by the response cache.", labels=["model"]
        )
        for model in self._statistics():
            entries.add_metric([model.model], model.entries)
            held.add_metric([model.model], model.bytes)
        return [entries, held]
