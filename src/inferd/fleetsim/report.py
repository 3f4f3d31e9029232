"""What a simulated run measured, over the requests that arrived in the measured window (after warmup):
throughput, latency percentiles (arrival to answer, the profile's overhead included), outcomes, mean
batch size."""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np


class Outcome(enum.IntEnum):
    PENDING = 0
    OK = 1
    REJECTED = 2
    """429 at admission (queue full, deadline unmeetable)."""
    FAILED = 3
    """5xx, expired, or the front end was lost."""
    TIMEOUT = 4
    """Answered after the client's deadline, or never."""
    LIMITED = 5
    """429 from the tenant's own quota (the gateway, before the queue)."""


class FinishedRun(Protocol):
    """What a finished simulation holds (batch_fleet.BatchFleet)."""

    spec: Any
    outcome: np.ndarray
    done_at: np.ndarray
    batches: int
    batched_items: int
    batched_squares: int
    restarts: int

    @property
    def events_processed(self) -> int: ...


@dataclass(frozen=True, slots=True)
class SimReport:
    offered_rps: float
    throughput_rps: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    requests: int
    ok: int
    rejected: int
    failed: int
    timeouts: int
    mean_batch_size: float
    """Items per batch, over batches."""
    answer_batch_size: float
    """The batch size an answer saw, averaged over answers (what `inferd bench` reports as its mean)."""
    restarts: int
    events: int
    devices_min: int = 0
    """With the autoscaler: the fewest and most devices it ran, and how many times it changed the count."""
    devices_max: int = 0
    scale_changes: int = 0
    limited: int = 0
    """Refused by their tenant's quota."""
    tenants: dict[str, Any] | None = None
    """Per tenant: requests, ok, limited, p99_ms."""
    zones: dict[str, Any] | None = None
    """With zones: per client zone (and in all) requests, goodput, failures, p99, in-zone share, and per
    phase around a zone's loss (fleetsim/zones.py `summary`)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def build(cls, fleet: FinishedRun, end_s: float) -> SimReport:
        spec = fleet.spec
        arrivals = spec.arrivals
        window = arrivals >= spec.warmup_s
        measured_s = max(1e-9, end_s - spec.warmup_s)
        outcome = fleet.outcome.copy()
        latency = fleet.done_at - arrivals + spec.profile.overhead_s
        late = (
            (outcome == Outcome.OK) & (spec.timeout_s is not None) & (latency > (spec.timeout_s or math.inf))
        )
        outcome[late] = Outcome.TIMEOUT
        outcome[outcome == Outcome.PENDING] = Outcome.TIMEOUT
        ok = window & (outcome == Outcome.OK)
        values = latency[ok] * 1000.0
        q = np.percentile(values, [50, 90, 99, 99.9]) if values.size else [None] * 4
        return cls(
            offered_rps=round(int(window.sum()) / measured_s, 3),
            throughput_rps=round(int(ok.sum()) / measured_s, 3),
            p50_ms=_r(q[0]),
            p90_ms=_r(q[1]),
            p99_ms=_r(q[2]),
            p999_ms=_r(q[3]),
            requests=int(window.sum()),
            ok=int(ok.sum()),
            rejected=int((window & (outcome == Outcome.REJECTED)).sum()),
            failed=int((window & (outcome == Outcome.FAILED)).sum()),
            timeouts=int((window & (outcome == Outcome.TIMEOUT)).sum()),
            mean_batch_size=round(fleet.batched_items / fleet.batches, 3) if fleet.batches else 0.0,
            answer_batch_size=round(fleet.batched_squares / fleet.batched_items, 3) if fleet.batches else 0.0,
            restarts=fleet.restarts,
            events=fleet.events_processed,
            **_scaling(getattr(fleet, "scaling", None), spec.devices),
            limited=int((window & (outcome == Outcome.LIMITED)).sum()),
            tenants=None
            if getattr(fleet, "tenants", None) is None
            else fleet.tenants.summary(
                outcome == Outcome.OK, outcome == Outcome.LIMITED, latency * 1000.0, window
            ),  # type: ignore[attr-defined]
            zones=None
            if getattr(fleet, "zones", None) is None
            else fleet.zones.summary(  # type: ignore[attr-defined]
                outcome, latency * 1000.0, arrivals, spec.warmup_s, end_s, spec.failures, spec.overprovisioning
            ),
        )


def _scaling(scaling: Any, devices: int) -> dict[str, int]:
    seen = [devices, *scaling.devices_seen] if scaling is not None else [devices]
    return {
        "devices_min": min(seen),
        "devices_max": max(seen),
        "scale_changes": 0 if scaling is None else scaling.changes,
    }


def _r(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)
