"""The llm kind's rows in the admin API (runtime/admin_view.py): its engines' sequences, KV use and
cache hits, and each worker's live sequences."""

from __future__ import annotations

from typing import Any

from inferd.runtime.admin_view import AdminView
from inferd.runtime.contract import RuntimeStatistics, WorkerSnapshot


def llm_model_row(stats: RuntimeStatistics) -> dict[str, Any]:
    """An LLM model as `inferd status` shows it: its engines' sequences, KV use and cache hits."""
    s = stats.detail
    total = s.kv_blocks_total
    return {
        "ready": stats.ready,
        "workers": s.workers,
        "streams": s.streams,
        "running": s.running,
        "waiting": s.waiting,
        "held": s.held,
        "cold_for_s": None if s.cold_for_s is None else round(s.cold_for_s, 3),
        "kv_usage": round(s.kv_blocks_used / total, 3) if total else None,
        "prefix_hit_ratio": round(s.prefix_hit_tokens / s.prefix_query_tokens, 3)
        if s.prefix_query_tokens
        else None,
        "preemptions": s.preemptions,
        "rejected": s.rejected,
        "moved": s.moved,
        "lost": s.lost,
    }


def llm_worker_row(w: WorkerSnapshot, now: float) -> dict[str, Any]:
    return {"live_sequences": w.load}


LLM_ADMIN = AdminView(section="llm_models", model_row=llm_model_row, worker_row=llm_worker_row)
