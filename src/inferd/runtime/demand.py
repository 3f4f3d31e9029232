"""A kind's autoscaling demand: how a model of the kind is observed, and how many workers one
observation alone asks for. Each kind that scales declares its own (`Kind.autoscaling`: batch models on
arrival rate against full-batch capacity, kinds/batch/demand.py; LLM models on their engines' pressure,
kinds/llm/demand.py). The Autoscaler (fleet/autoscaler.py) damps what they recommend (windows,
cooldowns, steps) the same way for every kind, and the scaling loop (fleet/scaling.py) observes a model
through its kind's observer every interval. Plain objects: an injected clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from inferd.clock import Clock
from inferd.config.autoscaler import AutoscalerConfig
from inferd.runtime.contract import RuntimeStatistics
from inferd.runtime.frontend_load import FrontendLoads

Clamp = Callable[[int], int]
"""Bounds a worker count within the policy's [min_workers, max_workers]."""


@dataclass(frozen=True, slots=True)
class Recommendation:
    workers: int
    why: str


class Observed(Protocol):
    """A model's fleet now, as its kind measures it (all rates and latencies measured, never config)."""

    @property
    def ready_workers(self) -> int: ...

    @property
    def starting_workers(self) -> int: ...

    def signals(self) -> dict[str, Any]:
        """The signals it scales on, as the admin API shows them."""
        ...


class Demand(Protocol):
    """What one observation alone asks of the fleet; the Autoscaler damps it."""

    def recommend(self, obs: Observed, current: int, clamp: Clamp) -> Recommendation: ...


class Observer(Protocol):
    """One model's observations, every interval (it may keep what it measured last: an arrival rate)."""

    def observe(self, stats: RuntimeStatistics, starting: int, others: FrontendLoads | None) -> Observed:
        """`stats`: the model's default version now; `starting`: its workers started and not yet joined;
        `others`: the other front ends' reported loads (the owner of several front ends), else None."""
        ...


@dataclass(frozen=True, slots=True)
class Autoscaling:
    """A kind's autoscaling: its demand policy and its observer, each built once per scaled model."""

    demand: Callable[[AutoscalerConfig], Demand]
    observer: Callable[[Clock], Observer]
