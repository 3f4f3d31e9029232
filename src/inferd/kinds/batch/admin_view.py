"""The batch kind's rows in the admin API (runtime/admin_view.py): its queue, balancer and batches, and
each worker's in-flight batches, latency, ejection and credits."""

from __future__ import annotations

from typing import Any

from inferd.routing.ejection import EjectionRecord
from inferd.runtime.admin_view import AdminView, plain
from inferd.runtime.contract import RuntimeStatistics, WorkerSnapshot


def batch_model_row(stats: RuntimeStatistics) -> dict[str, Any]:
    """A batch model as `inferd status` shows it (this front end's queue and busy ratio)."""
    d = stats.detail
    return {
        "ready": stats.ready,
        "stalled": d.stalled,
        "balancer": plain(d.balancer),
        "ready_workers": stats.ready_workers,
        "queued": stats.queued,
        "isolation_batches": d.isolation_batches,
        "batch_timeout_s": d.batch_timeout_s,
        "busy_ratio": round(min(1.0, max(0.0, d.busy_ratio)), 3),
        "cold_for_s": None if d.cold_for_s is None else round(d.cold_for_s, 3),
    }


def batch_worker_row(w: WorkerSnapshot, now: float) -> dict[str, Any]:
    d = w.detail
    return {
        "inflight_batches": w.load,
        "latency_ms": round(1000 * d.latency_s, 1),
        "ejection": _ejection(d.ejection, now),
        "credits": d.credits,
        "batch_high_water": d.high_water,
    }


def _ejection(record: EjectionRecord, now: float) -> dict[str, Any]:
    until = record.ejected_until
    return {
        "state": record.health.name.lower(),
        "times_ejected": record.times_ejected,
        "ejected_for_s": None if until is None else round(max(0.0, until - now), 3),
        "consecutive_failures": record.consecutive_failures,
        "reason": record.reason,
    }


BATCH_ADMIN = AdminView(section="models", model_row=batch_model_row, worker_row=batch_worker_row)
