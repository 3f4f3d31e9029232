"""Gauges read at scrape time from every served runtime's snapshot (one statistics() per runtime per
scrape): workers and their load for every kind, the work sent to each zone (the kinds that route by zone),
then each kind's own families (`Kind.metric_families`, declared in the kind's package), in the order the
kinds were registered."""

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
        families = [*worker_families(snapshots, counted), *zone_families(snapshots)]
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



def zone_families(snapshots: list[RuntimeStatistics]) -> list[Any]:
    """Where each model version's work went, by zone, on a front end with a zone whose workers have zones
    (routing/locality.py): the share served in its own zone is the rate of `local="true"` over the rate of
    all of `inferd_requests_by_zone_total`. Workers without a zone are zone "". None of these families
    while no model routes by zone."""
    zoned = [(s, s.locality) for s in snapshots if s.locality is not None and s.locality.active]
    if not zoned:
        return []
    labels = ["model", "version", "zone", "local"]
    served = CounterMetricFamily(
        "inferd_requests_by_zone",
        "Units of work sent to the workers of each zone (batch items, LLM sequences); local: the front "
        "end's own zone.",
        labels=labels,
    )
    spilled = CounterMetricFamily(
        "inferd_requests_spilled_by_zone",
        "Of those, sent beyond the zone shares because the zones with a share were short of capacity (load spill).",
        labels=labels,
    )
    share = GaugeMetricFamily(
        "inferd_zone_share",
        "The share of the model's work the zone routing gives each zone now (failback included).",
        labels=labels,
    )
    for s, locality in zoned:
        for z in locality.zones:
            key = [s.name, str(s.version), z.zone, "true" if z.local else "false"]
            served.add_metric(key, z.served)
            spilled.add_metric(key, z.spilled)
            share.add_metric(key, z.share)
    return [served, spilled, share]
