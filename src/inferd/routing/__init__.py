"""Policies the kinds share: which worker takes a batch (p2c balancer), which workers sit out (outlier
ejection), all in one health vocabulary (routing.health) and one backoff (routing.backoff); how many
retries a server may spend (routing.retry); the priority classes and fairness between tenants
(routing.fairness). The upstream kind's pool of engines (kinds/upstream/pool.py) speaks the same health."""

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
