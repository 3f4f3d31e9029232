"""`inferd status`: the admin API's worker and model lists as tables, once or every N seconds.

Reads GET /admin/workers and GET /admin/models (src/inferd/api/admin.py), and the gateway's
GET /admin/tenants, GET /admin/cache and GET /admin/traffic when the server has them
(cli/gateway_status.py), and GET /admin/pools (cli/pool_status.py). Exits 1, with
a message that says what to do, when the admin API cannot be reached or refuses the token.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from inferd.cli import ports
from inferd.cli.gateway_status import gateway_parts
from inferd.cli.pool_status import pools_parts
from inferd.config import ConfigError

FETCH_TIMEOUT_S = 5.0
STATE_STYLES = {
    "ready": "green",
    "starting": "cyan",
    "suspect": "yellow",
    "draining": "yellow",
    "dead": "red",
}


class AdminUnavailable(Exception):
    """The admin API could not be read; the message names the URL and says what to do."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status it answered, when it answered one."""


@dataclass(frozen=True, slots=True)
class AdminSnapshot:
    workers: dict[str, Any]
    models: dict[str, Any]
    tenants: dict[str, Any] | None = None
    """GET /admin/tenants (None: the server has no such page)."""
    cache: dict[str, Any] | None = None
    """GET /admin/cache (None: the server has no such page)."""
    traffic: dict[str, Any] | None = None
    """GET /admin/traffic (None: the server has no such page)."""
    pools: dict[str, Any] | None = None
    """GET /admin/pools (None: the server has no such page)."""

    def as_json(self) -> str:
        pages = {
            "workers": self.workers,
            "models": self.models,
            "tenants": self.tenants,
            "cache": self.cache,
            "traffic": self.traffic,
            "pools": self.pools,
        }
        return json.dumps({name: page for name, page in pages.items() if page is not None})


def fetch_optional(url: str, token: str | None) -> dict[str, Any] | None:
    """A page that older servers, or servers without it, answer 404: None then."""
    try:
        return fetch_json(url, token)
    except AdminUnavailable as exc:
        if exc.status == 404:
            return None
        raise


def fetch_json(url: str, token: str | None, timeout_s: float = FETCH_TIMEOUT_S) -> dict[str, Any]:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # nosec B310  # http(s): ports.admin_url
            body = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            hint = "the token was refused" if token else "it requires a token"
            raise AdminUnavailable(
                f"{url} answered 401 Unauthorized: {hint}; pass --token or set INFERD_ADMIN_TOKEN "
                "to the server's admin token"
            ) from None
        raise AdminUnavailable(f"{url} answered HTTP {exc.code} {exc.reason}", exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AdminUnavailable(
            f"cannot reach the admin API at {url} ({reason}); is `inferd serve` running, "
            "and is this its admin address (its HTTP port + 2 unless it set --admin-port: "
            "pass --port or --admin-url)?"
        ) from None
    try:
        payload = json.loads(body)
    except ValueError:
        raise AdminUnavailable(f"{url} did not answer JSON (first bytes: {body[:80]!r})") from None
    if not isinstance(payload, dict):
        raise AdminUnavailable(f"{url} answered {type(payload).__name__} JSON, expected an object")
    return payload


def fetch_snapshot(admin_url: str, token: str | None) -> AdminSnapshot:
    base = admin_url.rstrip("/")
    return AdminSnapshot(
        workers=fetch_json(f"{base}/admin/workers", token),
        models=fetch_json(f"{base}/admin/models", token),
        tenants=fetch_optional(f"{base}/admin/tenants", token),
        cache=fetch_optional(f"{base}/admin/cache", token),
        traffic=fetch_optional(f"{base}/admin/traffic", token),
        pools=fetch_optional(f"{base}/admin/pools", token),
    )


def _age(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"


def _version_cell(row: dict[str, Any]) -> str:
    """The row's version, starred when it is the model's default (unversioned requests go there)."""
    version = row.get("version")
    if version is None:
        return "-"
    return f"{version}*" if row.get("default") else str(version)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def workers_table(workers: list[dict[str, Any]]) -> Table:
    table = Table(title="workers", title_justify="left")
    for header in ("id", "model", "version", "state", "pid", "host", "zone"):
        table.add_column(header)
    for header in ("in-flight / seqs", "latency", "completed", "restarts", "progress age", "heartbeat age"):
        table.add_column(header, justify="right")
    for w in workers:
        state = _cell(w.get("state"))
        latency = w.get("latency_ms")
        table.add_row(
            _cell(w.get("worker_id")),
            _cell(w.get("model")),
            _cell(w.get("version")),
            Text(state, style=STATE_STYLES.get(state, "")),
            _cell(w.get("pid")),
            _cell(w.get("host")),
            _cell(w.get("zone")),
            _cell(w.get("inflight_batches", w.get("live_sequences"))),
            f"{latency:.0f} ms" if isinstance(latency, int | float) else "-",
            _cell(w.get("completed_batches")),
            _cell(w.get("restarts")),
            _age(w.get("last_progress_s_ago")),
            _age(w.get("last_heartbeat_s_ago")),
        )
    return table


def models_table(models: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="models", title_justify="left")
    table.add_column("model")
    table.add_column("version")
    for header in ("ready", "stalled", "ready workers", "queued", "batch timeout", "busy ratio"):
        table.add_column(header, justify="right")
    for name, m in sorted(models.items()):
        busy = m.get("busy_ratio")
        timeout = m.get("batch_timeout_s")
        table.add_row(
            name.split(":")[0],
            _version_cell(m),
            Text("yes", style="green") if m.get("ready") else Text("no", style="red"),
            Text("yes", style="red") if m.get("stalled") else Text("no"),
            _cell(m.get("ready_workers")),
            _cell(m.get("queued")),
            f"{timeout:.1f} s" if isinstance(timeout, int | float) else "-",
            f"{busy:.0%}" if isinstance(busy, int | float) else "-",
        )
    return table


def llm_models_table(models: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="LLM models", title_justify="left")
    table.add_column("model")
    table.add_column("version")
    headers = ("ready", "workers", "streams", "running", "waiting", "KV used", "prefix hits", "preempted")
    for header in (*headers, "refused", "moved"):
        table.add_column(header, justify="right")
    for name, m in sorted(models.items()):
        kv, hits = m.get("kv_usage"), m.get("prefix_hit_ratio")
        table.add_row(
            name.split(":")[0],
            _version_cell(m),
            Text("yes", style="green") if m.get("ready") else Text("no", style="red"),
            _cell(m.get("workers")),
            _cell(m.get("streams")),
            _cell(m.get("running")),
            _cell(m.get("waiting")),
            f"{kv:.0%}" if isinstance(kv, int | float) else "-",
            f"{hits:.0%}" if isinstance(hits, int | float) else "-",
            _cell(m.get("preemptions")),
            _cell(m.get("rejected")),
            _cell(m.get("moved")),
        )
    return table


def autoscaler_lines(models: dict[str, dict[str, Any]]) -> list[str]:
    """One line per autoscaled model: its latest decision and its latest changes of the fleet."""
    lines = []
    for name, m in sorted(models.items()):
        a = m.get("autoscaler")
        if not a:
            continue
        last = a.get("last")
        now = f"{last['from']} -> {last['to']} ({last['reason']})" if last else "no decision yet"
        lines.append(f"autoscaler {name}: {now}")
        for c in a.get("changes", [])[-5:]:
            at = time.strftime("%H:%M:%S", time.localtime(c["at"]))
            lines.append(f"  {at}  {c['from']} -> {c['to']}  {c['reason']}")
    return lines


def retry_budget_line(budget: dict[str, Any] | None) -> str:
    if not budget:
        return "retry budget: not reported"
    return (
        f"retry budget: balance {budget.get('balance', '-')}, "
        f"{budget.get('requests_in_window', '-')} requests and {budget.get('retries_in_window', '-')} "
        f"retries in the window, exhausted {budget.get('exhausted_total', '-')} times"
    )


def _frontend(frontend: Any) -> str:
    """' (front end ID, zone Z)' as GET /admin/workers says; '' from a server that does not say."""
    if not isinstance(frontend, dict) or not frontend.get("id"):
        return ""
    zone = frontend.get("zone")
    return f" (front end {frontend['id']}{f', zone {zone}' if zone else ''})"


def _grpc(address: Any) -> str:
    """'; gRPC API on HOST:PORT' as GET /admin/workers says; '' without one (or from an older server)."""
    return f"; gRPC API on {address}" if isinstance(address, str) and address else ""


def render_snapshot(snapshot: AdminSnapshot, admin_url: str, error: str | None = None) -> RenderableType:
    parts: list[RenderableType] = [
        workers_table(list(snapshot.workers.get("workers", []))),
        models_table(dict(snapshot.models.get("models", {}))),
        *([llm_models_table(llm)] if (llm := dict(snapshot.models.get("llm_models", {}))) else []),
        *(
            Text(line)
            for line in autoscaler_lines(
                {**dict(snapshot.models.get("models", {})), **dict(snapshot.models.get("llm_models", {}))}
            )
        ),
        Text(retry_budget_line(snapshot.models.get("retry_budget"))),
        *gateway_parts(snapshot.tenants, snapshot.cache, snapshot.traffic),
        *pools_parts(snapshot.pools),
        Text(
            f"from {admin_url}{_frontend(snapshot.workers.get('frontend'))}{_grpc(snapshot.workers.get('grpc'))} "
            f"at {time.strftime('%H:%M:%S')}",
            style="dim",
        ),
    ]
    if error is not None:
        parts.append(Text(f"last refresh failed: {error}", style="bold red"))
    return Group(*parts)


def watch_loop(
    snapshot: AdminSnapshot,
    fetch: Callable[[], AdminSnapshot],
    show: Callable[[AdminSnapshot, str | None], None],
    interval_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """After `snapshot` was shown, refresh every `interval_s` until Ctrl-C. A failed refresh keeps the
    last snapshot, marked with the error: a server restarting should not end the watch."""
    try:
        while True:
            sleep(interval_s)
            try:
                snapshot, error = fetch(), None
            except AdminUnavailable as exc:
                error = str(exc)
            show(snapshot, error)
    except KeyboardInterrupt:
        return


def show_json(snapshot: AdminSnapshot, error: str | None) -> None:
    """One JSON object per refresh (JSON lines under --watch); errors go to stderr."""
    if error is not None:
        typer.echo(f"error: {error}", err=True)
    else:
        typer.echo(snapshot.as_json())


def status(
    admin_url: Annotated[
        str | None,
        typer.Option(
            help="Base URL of the admin API, for a server started with its own --admin-port "
            "(default: from --host and --port)."
        ),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Host of the server's HTTP API (default: 127.0.0.1).")
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            help="Port of the server's HTTP API (its --port); its admin API is on this port + 2 "
            "(default: 8000, so admin 8002)."
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(envvar="INFERD_ADMIN_TOKEN", help="Admin bearer token (default: $INFERD_ADMIN_TOKEN)."),
    ] = None,
    watch: Annotated[
        float | None, typer.Option(help="Refresh every N seconds until Ctrl-C.", min=0.1)
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the raw JSON of both endpoints.")
    ] = False,
) -> None:
    """Show the workers and models of a running inferd server, from its admin API (found on the HTTP
    port + 2, as `inferd serve` puts it, unless --admin-url says where)."""
    try:
        url = ports.admin_url(admin_url, host, port)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

    def fetch() -> AdminSnapshot:
        return fetch_snapshot(url, token)

    try:
        snapshot = fetch()
    except AdminUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if json_output:
        show_json(snapshot, None)
        if watch is not None:
            watch_loop(snapshot, fetch, show_json, watch)
        return
    console = Console()
    if watch is None:
        console.print(render_snapshot(snapshot, url))
        return
    with Live(render_snapshot(snapshot, url), console=console, auto_refresh=False) as live:
        watch_loop(
            snapshot,
            fetch,
            lambda snap, error: live.update(render_snapshot(snap, url, error), refresh=True),
            watch,
        )
