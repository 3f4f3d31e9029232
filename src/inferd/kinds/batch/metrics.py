"""Prometheus gauges of the batch runtimes, read at scrape time from each runtime's statistics() (its
queue, its devices' busy share, its batches in flight): the batch kind's `Kind.metric_families`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from inferd.runtime.contract import RuntimeStatistics


def batch_families(snapshots: Iterable[RuntimeStatistics]) -> list[Any]:
    """The queue and device gauges of the batch-kind snapshots (detail: the batch runtime's statistics)."""
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
