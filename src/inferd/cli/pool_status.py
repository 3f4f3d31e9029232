"""The pools' table of `inferd status` (GET /admin/pools): each pool worker, its budget and use, and the
models it holds (state, memory, idle, evictable); then each pooled model's demand and load backoff.
Shown only when the server has pools."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text


def _held(model: dict[str, Any]) -> str:
    """'a v1 ready 300 MiB idle 2.1s evictable'."""
    text = f"{model.get('model')} v{model.get('version')} {model.get('state')} {float(model.get('memory_mb', 0)):.0f} MiB"
    text += f" idle {float(model.get('idle_s', 0)):.1f}s"
    return text + (" evictable" if model.get("evictable") else "")


def pools_table(pools: list[dict[str, Any]]) -> Table:
    table = Table(title="pools", title_justify="left")
    for header in ("pool", "worker", "used MiB", "budget MiB", "waiting loads", "models held"):
        table.add_column(header, justify="right" if "MiB" in header or "loads" in header else "left")
    for pool in pools:
        workers = pool.get("workers") or []
        if not workers:
            table.add_row(str(pool.get("name")), "(none joined)", "-", "-", "-", "-")
        for w in workers:
            worker = str(w.get("worker_id")) + (" (draining)" if w.get("draining") else "")
            held = "\n".join(_held(m) for m in w.get("models") or []) or "-"
            table.add_row(
                str(pool.get("name")), worker, f"{float(w.get('used_mb', 0)):.0f}",
                f"{float(w.get('budget_mb', 0)):.0f}", str(w.get("waiting_loads", 0)), held,
            )
    return table


def pool_model_lines(pools: list[dict[str, Any]]) -> list[str]:
    """A line per pooled model with requests waiting, a load in flight or a load backoff."""
    lines = []
    for pool in pools:
        backoff = pool.get("backoff") or {}
        for m in pool.get("models") or []:
            key = f"{m.get('model')}:{m.get('version')}"
            parts = []
            if m.get("waiting"):
                parts.append(f"{m['waiting']} waiting, {m.get('serving', 0)} serving")
            if m.get("loading_on"):
                parts.append(f"loading on {m['loading_on']}")
            if key in backoff:
                parts.append(f"load failed ({backoff[key].get('error')}), next try in {backoff[key].get('retry_in_s')}s")
            if parts:
                lines.append(f"pool {pool.get('name')}: model {m.get('model')} v{m.get('version')}: " + "; ".join(parts))
    return lines


def pools_parts(page: dict[str, Any] | None) -> list[RenderableType]:
    pools = list((page or {}).get("pools") or [])
    if not pools:
        return []
    return [pools_table(pools), *(Text(line) for line in pool_model_lines(pools))]
