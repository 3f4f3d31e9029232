"""`inferd_quota_decisions_total{tenant, result}`, read at scrape time from the quota engine's snapshot
(gateway/quota_store.py `TenantQuotas.statistics()`): nothing is added to the request path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from inferd.gateway.quota_store import TenantQuotas


class QuotaCollector(Collector):
    """Quota decisions of the tenants that have limits (tenants come from the config file: the label
    set is bounded)."""

    def __init__(self, engine: Callable[[], TenantQuotas]) -> None:
        self._engine = engine

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        family = CounterMetricFamily(
            "inferd_quota_decisions",
            "Quota decisions by tenant: admitted, refused (429), or admitted_without_store (the quota "
            "store was unreachable and on_store_error is open).",
            labels=["tenant", "result"],
        )
        for tenant, usage in self._engine().statistics().tenants:
            family.add_metric([tenant, "admitted"], usage.admitted)
            family.add_metric([tenant, "refused"], usage.refused)
            family.add_metric([tenant, "admitted_without_store"], usage.admitted_without_store)
        return [family]
