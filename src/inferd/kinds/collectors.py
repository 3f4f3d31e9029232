"""Gauges read at scrape time from every served runtime's snapshot (one statistics() per runtime per
scrape): workers and their load for every kind, then each kind's own families (`Kind.metric_families`,
declared in the kind's package), in the order the kinds were registered."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from inferd.runtime.contract import RuntimeStatistics
from inferd.runtime.kinds import KindRegistry
from inferd.runtime.registry import ModelRegistry
from inferd.wire.connection import slot_of


class RuntimeCollector(Collector):
    def __init__(self, registry: ModelRegistry, kinds: KindRegistry) -> None:
        self._registry = registry
        self._kinds = kinds

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        snapshots = [rt.statistics() for rt in self._registry]
        by_kind: dict[str, list[RuntimeStatistics]] = {}
        for s in snapshots:
            by_kind.setdefault(s.kind, []).append(s)
        kinds = list(self._kinds)
        counted = frozenset(k.name for k in kinds if k.counts_workers)
        families = worker_families(snapshots, counted)
        for kind in kinds:
            if kind.metric_families is not None:
                families.extend(kind.metric_families(by_kind.get(kind.name, [])))
        return families


def worker_families(snapshots: list[RuntimeStatistics], counted: frozenset[str]) -> list[Any]:
    """Every runtime's readiness and workers; `inferd_workers` counts the states of the workers of the
    `counted` kinds (`Kind.counts_workers`)."""
    labels = ["model", "version"]
    workers = GaugeMetricFamily("inferd_workers", "Worker connections by state.", labels=[*labels, "state"])
    ready = GaugeMetricFamily(
        "inferd_model_ready", "1 while the model version takes requests.", labels=labels
    )
    load = GaugeMetricFamily(
        "inferd_worker_load",
        "What each worker holds: batches in flight (batch) or live sequences (llm); worker = its slot, so "
        "the label set is bounded by the fleet.",
        labels=[*labels, "worker"],
    )
    busy = CounterMetricFamily(
        "inferd_worker_busy_seconds", "Device seconds per worker connection.", labels=[*labels, "worker"]
    )
    done = CounterMetricFamily(
        "inferd_worker_batches",
        "Batches (batch) or engine steps (llm) completed per worker connection.",
        labels=[*labels, "worker"],
    )
    for s in snapshots:
        key = [s.name, str(s.version)]
        ready.add_metric(key, 1.0 if s.ready else 0.0)
        counts: dict[str, int] = {}
        for w in s.workers:
            counts[w.state] = counts.get(w.state, 0) + 1
            slot = slot_of(w.worker_id)
            load.add_metric([*key, slot], w.load)
            busy.add_metric([*key, slot], w.busy_s)
            done.add_metric([*key, slot], w.completed)
        if s.kind in counted:
            for state in ("ready", "draining"):
                workers.add_metric([*key, state], counts.get(state, 0))
    return [workers, ready, load, busy, done]

