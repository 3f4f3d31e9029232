"""Traffic split metrics: each version's share of unversioned requests, the requests each split sent
where, and canary rollbacks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class TrafficMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.weights = Gauge(
            "inferd_traffic_weight",
            "Share of the requests that name no version each version gets (canary or A/B arm).",
            ["model", "version"],
            registry=registry,
        )
        self.assignments = Counter(
            "inferd_traffic_assignments_total",
            "Requests that named no version, by the version the traffic split chose (per arm).",
            ["model", "version"],
            registry=registry,
        )
        self.rollbacks = Counter(
            "inferd_traffic_rollbacks_total",
            "Canaries rolled back to weight 0 by their rollback bounds.",
            ["model"],
            registry=registry,
        )
        self._assignments: dict[tuple[str, int], Counter] = {}

    def weight(self, model: str, version: int, share: float) -> None:
        self.weights.labels(model, str(version)).set(share)

    def assigned(self, model: str, version: int) -> None:
        child = self._assignments.get((model, version))
        if child is None:
            child = self._assignments[(model, version)] = self.assignments.labels(model, str(version))
        child.inc()

    def rolled_back(self, model: str) -> None:
        self.rollbacks.labels(model).inc()
