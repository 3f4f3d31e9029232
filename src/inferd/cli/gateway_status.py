"""The gateway's tables of `inferd status`: tenants (GET /admin/tenants), the response cache
(GET /admin/cache) and traffic splits with their history (GET /admin/traffic), each shown only when it
has rows."""

from __future__ import annotations

import time
from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _rate(limits: dict[str, Any]) -> str:
    rate = limits.get("requests_per_s")
    if rate is None:
        return "-"
    burst = limits.get("burst")
    return f"{rate:g}/s" + (f" (burst {burst})" if burst is not None else "")


def tenants_table(tenants: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="tenants", title_justify="left")
    for header in ("tenant", "keys", "models", "requests", "tokens/min", "max conc."):
        table.add_column(header, justify="left" if header in ("tenant", "models") else "right")
    for header in ("admitted", "refused", "in flight", "ok", "failed"):
        table.add_column(header, justify="right")
    for name, t in sorted(tenants.items()):
        limits = t.get("limits") or {}
        quota = t.get("quota") or {}
        outcomes: dict[str, int] = t.get("requests") or {}
        failed = sum(n for outcome, n in outcomes.items() if outcome != "ok")
        refused = quota.get("refused")
        table.add_row(
            name,
            _cell(t.get("keys")),
            ", ".join(limits.get("models") or []) or "all",
            _rate(limits),
            _cell(limits.get("tokens_per_min")),
            _cell(limits.get("max_concurrency")),
            _cell(quota.get("admitted")) if quota else "unlimited",
            Text(str(refused), style="yellow") if refused else _cell(refused),
            _cell(quota.get("in_flight")),
            str(outcomes.get("ok", 0)),
            Text(str(failed), style="red") if failed else "0",
        )
    return table


def _bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cache_table(models: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="response cache", title_justify="left")
    table.add_column("model")
    for header in ("hits", "misses", "bypass", "hit ratio", "entries", "bytes", "evicted", "expired"):
        table.add_column(header, justify="right")
    for name, c in sorted(models.items()):
        ratio = c.get("hit_ratio")
        table.add_row(
            name,
            _cell(c.get("hits")),
            _cell(c.get("misses")),
            _cell(c.get("bypass")),
            f"{ratio:.0%}" if isinstance(ratio, int | float) else "-",
            _cell(c.get("entries")),
            _bytes(c.get("bytes")),
            _cell(c.get("evictions")),
            _cell(c.get("expirations")),
        )
    return table


def quota_store_line(store: dict[str, Any] | None) -> str | None:
    """Only when something is wrong with the quota store: unreachable, or errors seen."""
    if not store or (store.get("up", True) and not store.get("store_errors")):
        return None
    state = "reachable" if store.get("up") else "UNREACHABLE"
    return f"quota store: {state}, {store.get('store_errors', 0)} errors; when unreachable, requests are " + (
        "admitted without quotas" if store.get("on_store_error") == "open" else "refused (503)"
    )


TRAFFIC_STYLES = {"active": "green", "rolled_back": "red", "promoted": "cyan"}
HISTORY_SHOWN = 10
"""The newest traffic events `inferd status` lists."""


def _shares(weights: dict[str, Any]) -> str:
    return ", ".join(f"v{v} {w:g}" for v, w in sorted(weights.items(), key=lambda kv: int(kv[0])))


def _step(split: dict[str, Any]) -> str:
    steps = split.get("steps") or []
    if split.get("mode") != "canary":
        return "-"
    if len(steps) < 2:
        return "fixed"
    return f"{int(split.get('step', 0)) + 1}/{len(steps)} (" + " > ".join(f"{s:g}" for s in steps) + ")"


def traffic_table(splits: list[dict[str, Any]]) -> Table:
    """One row per split: its mode, the versions' shares now, the canary's step and state."""
    table = Table(title="traffic", title_justify="left")
    for header in ("model", "mode", "weights", "canary", "canary weight", "step", "state"):
        table.add_column(header, justify="right" if header == "canary weight" else "left")
    for s in sorted(splits, key=lambda s: str(s.get("model"))):
        weights = dict(s.get("weights") or {})
        canary = s.get("canary_version")
        state = str(s.get("state", "-"))
        table.add_row(
            _cell(s.get("model")),
            _cell(s.get("mode")),
            _shares(weights),
            "-" if canary is None else f"v{canary}",
            "-" if canary is None else f"{weights.get(str(canary), 0.0):g}",
            _step(s),
            Text(state, style=TRAFFIC_STYLES.get(state, "")),
        )
    return table


def traffic_history_lines(history: list[dict[str, Any]]) -> list[str]:
    """The newest traffic events (rollbacks, promotions, steps, reloads): when, which version, why."""
    lines = []
    for e in history[-HISTORY_SHOWN:]:
        at = e.get("at")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if isinstance(at, int | float) else "-"
        lines.append(f"  {when}  {e.get('model')} v{e.get('version')}  {e.get('event')}: {e.get('reason')}")
    return ["traffic history (newest last):", *lines] if lines else []


def gateway_parts(
    tenants: dict[str, Any] | None, cache: dict[str, Any] | None, traffic: dict[str, Any] | None = None
) -> list[RenderableType]:
    """The tenants, cache and traffic tables (and a quota store warning, the traffic history), each
    when there is something to show."""
    parts: list[RenderableType] = []
    if tenants and tenants.get("tenants"):
        parts.append(tenants_table(dict(tenants["tenants"])))
        if (line := quota_store_line(tenants.get("quota_store"))) is not None:
            parts.append(Text(line, style="bold red"))
    if cache and cache.get("models"):
        parts.append(cache_table(dict(cache["models"])))
    if traffic and traffic.get("splits"):
        parts.append(traffic_table(list(traffic["splits"])))
    if traffic:
        parts.extend(Text(line) for line in traffic_history_lines(list(traffic.get("history") or [])))
    return parts
