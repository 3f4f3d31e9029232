"""Gauges read at scrape time from every served runtime's snapshot (one statistics() per runtime per
scrape): workers and their load for every kind, then each kind's own families."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from inferd.kinds.llm.metrics import llm_families
from inferd.kinds.upstream.metrics import upstream_families
from inferd.runtime.contract import RuntimeStatistics
from inferd.runtime.registry import ModelRegistry
from inferd.wire.connection import slot_of


class RuntimeCollector(Collector):
    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        snapshots = [rt.statistics() for rt in self._registry]
        return [
            *worker_families(snapshots),
            *batch_families([s for s in snapshots if s.kind == "batch"]),
            *llm_families([s for s in snapshots if s.kind == "llm"]),
            *upstream_families([s for s in snapshots if s.kind == "upstream"]),
        ]


def worker_families(snapshots: list[RuntimeStatistics]) -> list[Any]:
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
        if s.kind in ("batch", "llm"):
            for state in ("ready", "draining"):
                workers.add_metric([*key, state], counts.get(state, 0))
    return [workers, ready, load, busy, done]


def batch_families(snapshots: list[RuntimeStatistics]) -> list[Any]:
    labels = ["model", "version"]
    depth = GaugeMetricFamily("inferd_queue_depth", "Items waiting in the model's queue.", labels=labels)
    bound = GaugeMetricFamily("inferd_queue_capacity", "Queue bound in items.", labels=labels)
    busy = GaugeMetricFamily(
        "inferd_device_busy_ratio",
        "Share of the last 10 s the model's devices spent computing.",
        labels=labels,
    )
    inflight = GaugeMetricFamily(
        "inferd_inflight_batches", "Batches sent to workers and not yet answered.", labels=labels
    )
    by_priority = GaugeMetricFamily(
        "inferd_queue_depth_by_priority", "Queued items by priority class.", labels=[*labels, "priority"]
    )
    for s in snapshots:
        d = s.detail
        key = [s.name, str(s.version)]
        depth.add_metric(key, d.queued_items)
        bound.add_metric(key, d.queue_capacity)
        busy.add_metric(key, d.busy_ratio)
        inflight.add_metric(key, sum(w.load for w in s.workers))
        by_priority.add_metric([*key, "interactive"], d.queued_interactive)
        by_priority.add_metric([*key, "bulk"], d.queued_bulk)
    return [depth, bound, busy, inflight, by_priority]
