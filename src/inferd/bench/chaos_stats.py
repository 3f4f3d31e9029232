"""The numbers of a chaos run's report: latency of the requests sent soon after an injection vs the
steady ones, and summaries of the measured recovery times."""

from __future__ import annotations

from typing import Any

import numpy as np
from hdrh.histogram import HdrHistogram


def after_injection_mask(rel_offsets: np.ndarray, injections_at: list[float], window_s: float) -> np.ndarray:
    """True for each intended time t with inj <= t < inj + window_s for some injection time inj."""
    offsets = np.asarray(rel_offsets, dtype=float)
    if not injections_at:
        return np.zeros(offsets.shape, dtype=bool)
    at = np.sort(np.asarray(injections_at, dtype=float))
    idx = np.searchsorted(at, offsets, side="right") - 1  # the latest injection at or before t
    latest = at[np.clip(idx, 0, None)]
    return (idx >= 0) & (offsets - latest < window_s)


def window_stats(results: np.ndarray) -> dict[str, Any]:
    """Requests sent, ok, failed, and latency of the ok ones (ms) among `results` (see `report`)."""
    results = np.asarray(results, dtype=float)
    sent = results[~np.isnan(results)]
    ok = sent[sent >= 0]
    latency: dict[str, float | None] = {"p50": None, "p99": None, "max": None}
    if ok.size:
        h = HdrHistogram(1, 60_000_000, 3)
        for us in np.maximum(1, (ok * 1e6).astype(np.int64)).tolist():
            h.record_value(us)
        latency = {
            "p50": h.get_value_at_percentile(50) / 1000.0,
            "p99": h.get_value_at_percentile(99) / 1000.0,
            "max": h.get_max_value() / 1000.0,
        }
    return {
        "sent": int(sent.size),
        "ok": int(ok.size),
        "failed": int(sent.size - ok.size),
        "latency_ms": latency,
    }


def recovery_ms(values_s: list[float | None]) -> dict[str, float | int | None]:
    measured = [v * 1000.0 for v in values_s if v is not None]
    return {
        "measured": len(measured),
        "missing": len(values_s) - len(measured),
        "p50": float(np.percentile(measured, 50)) if measured else None,
        "max": max(measured) if measured else None,
    }
