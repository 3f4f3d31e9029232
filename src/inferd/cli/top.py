"""`inferd top`: the live console's picture in the terminal (rich), from the same `GET /console/data`
the browser page reads (api/console.py, docs/console.md): models with their rates and latencies and a
sparkline of the last minutes, workers, rejections by reason, queues, tenants and traffic splits.

The data endpoint needs the admin token when the server has one or has tenants: --token or
INFERD_ADMIN_TOKEN. Bounded: --once, or --iterations N; otherwise until Ctrl-C.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

FETCH_TIMEOUT_S = 5.0
BARS = "▁▂▃▄▅▆▇█"


class ConsoleUnavailable(Exception):
    """The console's data could not be read; the message says why and what to do."""


def fetch_page(url: str, token: str | None) -> dict[str, Any]:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        request = urllib.request.Request(f"{url.rstrip('/')}/console/data", headers=headers)
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:  # nosec B310  # http(s) URL of the server
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        hint = " (pass --token or set INFERD_ADMIN_TOKEN)" if exc.code in (401, 403) else ""
        raise ConsoleUnavailable(f"{url} answered HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ConsoleUnavailable(
            f"cannot read {url}/console/data ({exc}); is `inferd serve` running there?"
        ) from None


def sparkline(values: list[float | None], width: int = 30) -> str:
    points = [v for v in values[-width:] if v is not None]
    if not points:
        return ""
    top = max(points) or 1.0
    return "".join(BARS[min(len(BARS) - 1, int(v / top * (len(BARS) - 1)))] for v in points)


def _n(value: Any) -> str:
    if value is None:
        return "-"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def _last(series: dict[str, list[Any]], key: str) -> Any:
    values = series.get(key) or []
    return values[-1] if values else None


def models_table(page: dict[str, Any]) -> Table:
    table = Table(title="models", title_justify="left")
    for header in ("model", "version", "kind", "ready", "workers"):
        table.add_column(header)
    for header in ("queued", "in flight", "req/s", "p50 ms", "p99 ms", "fill"):
        table.add_column(header, justify="right")
    table.add_column("req/s, last minutes")
    for m in page["models"]:
        s = page["series"].get(m["name"], {})
        table.add_row(
            m["name"],
            str(m["version"]),
            m["kind"],
            "[green]yes[/]" if m["ready"] else "[red]no[/]",
            f"{m['ready_workers']}/{m['workers']}",
            _n(m["queued"]),
            _n(m["in_flight"]),
            _n(_last(s, "rps")),
            _n(_last(s, "p50_ms")),
            _n(_last(s, "p99_ms")),
            _n(_last(s, "fill")),
            sparkline(s.get("rps", [])),
        )
    return table


def workers_table(page: dict[str, Any]) -> Table:
    table = Table(title="workers", title_justify="left")
    for header in ("worker", "model", "version", "state", "pid", "host"):
        table.add_column(header)
    for header in ("load", "completed", "batch latency ms"):
        table.add_column(header, justify="right")
    for w in page["workers"]:
        table.add_row(
            w["worker_id"], w["model"], str(w["version"]), w["state"], str(w["pid"]), w["host"],
            _n(w["load"]), _n(w["completed"]), _n(w["batch_latency_ms"]),
        )  # fmt: skip
    return table


def samples_table(page: dict[str, Any], title: str, names: tuple[str, ...]) -> Table | None:
    """The families' samples that moved (counters) or exist (gauges), by their labels."""
    rows = [
        (name, s)
        for name in names
        for s in page["metrics"].get(name, [])
        if not (name.endswith("_total") and not s["value"])
    ]
    if not rows:
        return None
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    table.add_column("labels")
    table.add_column("value", justify="right")
    for name, s in rows:
        table.add_row(name, " ".join(f"{k}={v}" for k, v in sorted(s["labels"].items())), _n(s["value"]))
    return table


def traffic_table(page: dict[str, Any]) -> Table | None:
    splits = (page.get("traffic") or {}).get("splits") or []
    if not splits:
        return None
    table = Table(title="traffic", title_justify="left")
    for header in ("model", "mode", "weights", "canary", "step", "state"):
        table.add_column(header)
    for s in splits:
        weights = " ".join(f"v{v}={w:.3g}" for v, w in s["weights"].items())
        table.add_row(s["model"], s["mode"], weights, _n(s["canary_version"]), str(s["step"]), s["state"])
    return table


def render(page: dict[str, Any]) -> Group:
    slo = tuple(sorted(n for n in page["metrics"] if n.startswith(("inferd_slo_", "inferd_search_"))))
    parts = [
        models_table(page),
        workers_table(page),
        samples_table(
            page,
            "rejections and queues",
            ("inferd_requests_rejected_total", "inferd_queue_depth_by_priority"),
        ),
        samples_table(page, "tenants", ("inferd_tenant_requests_total", "inferd_quota_decisions_total")),
        traffic_table(page),
        samples_table(page, "SLOs and search", slo),
    ]
    return Group(*(p for p in parts if p is not None))


def top(
    url: Annotated[str, typer.Option(help="The server's HTTP address.")] = "http://127.0.0.1:8000",
    token: Annotated[
        str | None,
        typer.Option(envvar="INFERD_ADMIN_TOKEN", help="The admin token, when the server has one."),
    ] = None,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between refreshes.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one picture and exit.")] = False,
    iterations: Annotated[int | None, typer.Option(min=1, help="Stop after N refreshes.")] = None,
) -> None:
    """The live console in the terminal: models, workers, queues, tenants, traffic, SLOs."""
    console = Console()
    try:
        if once:
            console.print(render(fetch_page(url, token)))
            return
        with Live(render(fetch_page(url, token)), console=console, auto_refresh=False) as live:
            done = 1
            while iterations is None or done < iterations:
                time.sleep(interval)
                live.update(render(fetch_page(url, token)), refresh=True)
                done += 1
    except ConsoleUnavailable as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
