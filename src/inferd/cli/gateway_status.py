"""The gateway's tables of `inferd status`: tenants (GET /admin/tenants) and the response cache
(GET /admin/cache), each shown only when it has rows."""

from __future__ import annotations

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


def gateway_parts(tenants: dict[str, Any] | None, cache: dict[str, Any] | None) -> list[RenderableType]:
    """The tenants and cache tables (and a quota store warning), each when there is something to show.
    Traffic splitting's state goes after these."""
    parts: list[RenderableType] = []
    if tenants and tenants.get("tenants"):
        parts.append(tenants_table(dict(tenants["tenants"])))
        if (line := quota_store_line(tenants.get("quota_store"))) is not None:
            parts.append(Text(line, style="bold red"))
    if cache and cache.get("models"):
        parts.append(cache_table(dict(cache["models"])))
    return parts
