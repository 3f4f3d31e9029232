"""The cluster's metrics, read at scrape time: `inferd_cluster_store_up` (1 while the shared store
answers the follow loop's reads, 0 while each front end serves the last state it read)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.registry import Collector


class StoreCollector(Collector):
    """`inferd_cluster_store_up` from `up` (e.g. `lambda: follower.up`, cluster/follower.py)."""

    def __init__(self, up: Callable[[], bool]) -> None:
        self._up = up

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        gauge = GaugeMetricFamily(
            "inferd_cluster_store_up",
            "1 while the shared store answers; 0 while this front end serves the last state it read.",
        )
        gauge.add_metric([], 1 if self._up() else 0)
        return [gauge]
