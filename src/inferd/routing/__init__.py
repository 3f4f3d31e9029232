"""Routing policies: which worker takes a batch (p2c balancer), which workers sit out (outlier ejection),
which upstream engine takes a request (upstream pool), all in one health vocabulary (routing.health) and
one backoff (routing.backoff)."""

from inferd.routing.backoff import Backoff
from inferd.routing.balancer import BalancerStatistics, Candidate, P2CBalancer
from inferd.routing.ejection import EjectionStatistics, OutlierEjector
from inferd.routing.health import Ejection, EjectionRecord, Health, HealthChange

__all__ = [
    "Backoff",
    "BalancerStatistics",
    "Candidate",
    "Ejection",
    "EjectionRecord",
    "EjectionStatistics",
    "Health",
    "HealthChange",
    "OutlierEjector",
    "P2CBalancer",
]
