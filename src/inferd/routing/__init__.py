"""Routing policies: which worker takes a batch (p2c balancer) and which workers sit out (outlier ejection)."""

from inferd.routing.balancer import BalancerStatistics, Candidate, Health, P2CBalancer
from inferd.routing.ejection import (
    EjectionChange,
    EjectionState,
    EjectionStatistics,
    OutlierEjector,
    WorkerEjection,
)

__all__ = [
    "BalancerStatistics",
    "Candidate",
    "EjectionChange",
    "EjectionState",
    "EjectionStatistics",
    "Health",
    "OutlierEjector",
    "P2CBalancer",
    "WorkerEjection",
]
