"""SLI events of every model with an `[slo]` table, and their short-window burn rates.

    inferd_slo_events_total{model, slo, result}     slo: availability | latency | ttft | itl;
                                                    result: good | bad (both exported from the start)
    inferd_slo_burn_rate{model, slo, window}        window: 5m | 30m (in process, slo_window.py)
    inferd_slo_objective{model, slo}                the target share of good events
    inferd_slo_threshold_seconds{model, slo}        latency SLOs: the threshold (a histogram bucket too)

What counts against availability: server-side failures (5xx: no worker, a worker lost, an internal
error), deadlines (504) and overload refusals (429 from a full queue or a saturated front end). A
tenant's own quota 429, other 4xx, and clients that went away are not availability events. Latency
events are successful requests only (a failed one already counts against availability).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from inferd.clock import Clock
from inferd.observability.slo_config import Objective, SloConfig
from inferd.observability.slo_window import SHORT_WINDOWS_S, BurnWindow

SERVER_FAULTS = frozenset({"deadline", "unavailable", "worker_died", "internal"})
"""Request outcomes (api/errors.py) that are the server's failure: 5xx and 504."""
TENANT_REFUSALS = frozenset({"quota"})
"""Overload reasons that are a tenant's own limit (gateway/quota_layer.py QuotaExceeded): not failures."""

EVENTS_METRIC = "inferd_slo_events_total"
BURN_RATE_METRIC = "inferd_slo_burn_rate"
OBJECTIVE_METRIC = "inferd_slo_objective"
THRESHOLD_METRIC = "inferd_slo_threshold_seconds"


def availability_event(outcome: str, rejected_reason: str | None) -> bool | None:
    """Whether a request is a good (True) or bad (False) availability event, or none (None)."""
    if outcome == "ok":
        return True
    if outcome in SERVER_FAULTS:
        return False
    if outcome == "rejected" and rejected_reason not in TENANT_REFUSALS:
        return False
    return None


@dataclass(frozen=True, slots=True)
class SloSnapshot:
    """One SLO of one model, as statistics() reports it."""

    model: str
    objective: Objective
    good: int
    bad: int
    burn_rates: tuple[tuple[str, float], ...]
    """(window label, burn rate) of the in-process windows."""


class ModelSlo:
    """The SLOs of one model: event counters bound once, and a burn window per SLO."""

    def __init__(self, events: Counter, model: str, objectives: tuple[Objective, ...], clock: Clock) -> None:
        self.model = model
        self.objectives = {o.slo: o for o in objectives}
        # indexed by `good` (False 0, True 1): the bad child first
        self._events = {
            o.slo: (events.labels(model, o.slo, "bad"), events.labels(model, o.slo, "good"))
            for o in objectives
        }
        self._counts = {o.slo: [0, 0] for o in objectives}
        """[bad, good] events since start, for statistics()."""
        span_s = max(SHORT_WINDOWS_S.values())
        self._windows = {o.slo: BurnWindow(clock, o.error_budget, span_s) for o in objectives}

    def request(self, outcome: str, rejected_reason: str | None, latency_s: float) -> None:
        """One logical request ended with `outcome` after `latency_s`."""
        good = availability_event(outcome, rejected_reason)
        if good is not None:
            self._record("availability", good)
        if outcome == "ok":
            self._latency("latency", latency_s)

    def first_token(self, ttft_s: float) -> None:
        self._latency("ttft", ttft_s)

    def tokens(self, n: int, itl_s: float) -> None:
        """`n` tokens arrived, each `itl_s` after the one before (on average)."""
        self._latency("itl", itl_s, n)

    def _latency(self, slo: str, seconds: float, n: int = 1) -> None:
        objective = self.objectives.get(slo)
        if objective is not None and objective.threshold_s is not None:
            # `<=`, as a histogram's `le` bucket counts: the dashboard's quantiles agree with the events
            self._record(slo, seconds <= objective.threshold_s, n)

    def _record(self, slo: str, good: bool, n: int = 1) -> None:
        self._events[slo][good].inc(n)
        self._counts[slo][good] += n
        self._windows[slo].add(good, n)

    def snapshots(self) -> list[SloSnapshot]:
        return [
            SloSnapshot(
                self.model,
                objective,
                good=self._counts[slo][1],
                bad=self._counts[slo][0],
                burn_rates=tuple(
                    (label, self._windows[slo].burn_rate(window_s))
                    for label, window_s in SHORT_WINDOWS_S.items()
                ),
            )
            for slo, objective in self.objectives.items()
        ]


class SloMetrics:
    """The SLOs of every model that has some; models without an `[slo]` table are not counted."""

    def __init__(self, registry: CollectorRegistry, slos: Mapping[str, SloConfig], clock: Clock) -> None:
        events = Counter(
            EVENTS_METRIC,
            "SLI events by model, SLO (availability, latency, ttft, itl) and result (good, bad).",
            ["model", "slo", "result"],
            registry=registry,
        )
        self._models = {name: ModelSlo(events, name, slo.objectives(), clock) for name, slo in slos.items()}
        registry.register(SloCollector(self))

    def for_model(self, model: str) -> ModelSlo | None:
        """The model's SLO accounting; None when it has no `[slo]` table."""
        return self._models.get(model)

    def request(self, model: str, outcome: str, rejected_reason: str | None, latency_s: float) -> None:
        """One logical request of `model` ended (api/middleware.py Accounting)."""
        slo = self._models.get(model)
        if slo is not None:
            slo.request(outcome, rejected_reason, latency_s)

    def statistics(self) -> tuple[SloSnapshot, ...]:
        return tuple(s for m in self._models.values() for s in m.snapshots())


class SloCollector(Collector):
    """Burn rates, objectives and thresholds, read at scrape time from SloMetrics.statistics()."""

    def __init__(self, slos: SloMetrics) -> None:
        self._slos = slos

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        burn = GaugeMetricFamily(
            BURN_RATE_METRIC,
            "Bad share of an SLO's events over its error budget, in the process's recent windows "
            "(1: the budget is spent exactly over the SLO period).",
            labels=["model", "slo", "window"],
        )
        objective = GaugeMetricFamily(
            OBJECTIVE_METRIC, "Share of an SLO's events that must be good.", labels=["model", "slo"]
        )
        threshold = GaugeMetricFamily(
            THRESHOLD_METRIC,
            "Latency SLOs: the duration a good event stays within.",
            labels=["model", "slo"],
        )
        for s in self._slos.statistics():
            labels = [s.model, s.objective.slo]
            objective.add_metric(labels, s.objective.target)
            if s.objective.threshold_s is not None:
                threshold.add_metric(labels, s.objective.threshold_s)
            for window, rate in s.burn_rates:
                burn.add_metric([*labels, window], rate)
        return [burn, objective, threshold]
