"""The pools' families on the front end's /metrics.

* `inferd_model_loads_total{model}` and `inferd_model_evictions_total{model}`: the pool workers' own
  cumulative counters (PoolState.loads / .evictions), summed over every pool worker at scrape time (a
  collector: nothing is incremented per message). A worker that left keeps its last counts, and so does
  a process restarted under the same worker id, so the sums never go down while this front end runs.
* `inferd_model_load_seconds{model}`: a histogram, observed from each successful LoadResult.
* `inferd_pool_memory_used_mb{pool,worker}`, `inferd_pool_memory_budget_mb{pool,worker}` and
  `inferd_pool_models_loaded{pool,worker}`: each connected pool worker's last PoolState.

Every front end sees every pool worker's PoolState and LoadResult. With several front ends (`--frontends
N`), the whole server's /metrics labels each front end's samples (frontends/metrics.py): so that a sum
over front ends does not count a pool worker N times, only the front end that owns the local workers
exports these families (`export`); the others keep theirs empty.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferd.wire import protocol as p

LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class PoolMetrics(Collector):
    def __init__(self, registry: CollectorRegistry | None, export: bool = True) -> None:
        self.export = export and registry is not None
        self._counts: dict[tuple[str, str, str], p.PoolState] = {}
        """(pool, worker, process) -> its last PoolState, kept after it leaves (its cumulative counters: a
        process restarted under the same worker id counts from 0 again, beside the old one's)."""
        self._live: dict[tuple[str, str], str] = {}
        """(pool, worker) -> the process behind its link now."""
        self._load_seconds: Histogram | None = None
        if self.export and registry is not None:
            self._load_seconds = Histogram(
                "inferd_model_load_seconds",
                "Time a pool worker took to load (and warm up) a model, as the worker measured it.",
                ["model"],
                buckets=LOAD_BUCKETS,
                registry=registry,
            )
            registry.register(self)

    def counted(self, pool: str, worker: str, state: p.PoolState, process: str = "") -> None:
        """A pool worker's PoolState; `process` tells its processes apart (host:pid)."""
        self._counts[(pool, worker, process)] = state
        self._live[(pool, worker)] = process

    def gone(self, pool: str, worker: str) -> None:
        self._live.pop((pool, worker), None)

    def loaded(self, model: str, load_s: float) -> None:
        if self._load_seconds is not None:
            self._load_seconds.labels(model).observe(load_s)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if not self.export:
            return
        loads = CounterMetricFamily("inferd_model_loads", "Model loads that ended ready on pool workers.", labels=["model"])
        evictions = CounterMetricFamily(
            "inferd_model_evictions", "Models that pool workers evicted to make room.", labels=["model"]
        )
        for family, counts in ((loads, _loads), (evictions, _evictions)):
            totals: dict[str, int] = {}
            for state in self._counts.values():
                for model, count in counts(state).items():
                    totals[model] = totals.get(model, 0) + count
            for model, total in sorted(totals.items()):
                family.add_metric([model], total)
        yield loads
        yield evictions
        labels = ["pool", "worker"]
        used = GaugeMetricFamily("inferd_pool_memory_used_mb", "What a pool worker's models take (MiB).", labels=labels)
        budget = GaugeMetricFamily("inferd_pool_memory_budget_mb", "A pool worker's memory budget (MiB).", labels=labels)
        held = GaugeMetricFamily("inferd_pool_models_loaded", "Models a pool worker holds.", labels=labels)
        for key, process in sorted(self._live.items()):
            state = self._counts[(*key, process)]
            used.add_metric(list(key), state.used_mb)
            budget.add_metric(list(key), state.budget_mb)
            held.add_metric(list(key), sum(1 for m in state.models if m.state == "ready"))
        yield used
        yield budget
        yield held


def _loads(state: p.PoolState) -> dict[str, int]:
    return state.loads


def _evictions(state: p.PoolState) -> dict[str, int]:
    return state.evictions
