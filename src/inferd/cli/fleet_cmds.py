"""`inferd drain`, `inferd scale` and `inferd update`: fleet changes through the admin API."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Annotated, Any

import typer

from inferd.cli import ports
from inferd.config import ConfigError

AdminUrl = Annotated[
    str | None,
    typer.Option(
        help="Base URL of the server's admin API, for a server started with its own --admin-port "
        "(default: from --host and --port)."
    ),
]
Host = Annotated[str | None, typer.Option(help="Host of the server's HTTP API (default: 127.0.0.1).")]
Port = Annotated[
    int | None,
    typer.Option(
        help="Port of the server's HTTP API (its --port); its admin API is on this port + 2 (default: 8000, "
        "so admin 8002)."
    ),
]
Token = Annotated[
    str | None, typer.Option(envvar="INFERD_ADMIN_TOKEN", help="Admin token (default: INFERD_ADMIN_TOKEN).")
]


def _base(admin_url: str | None, host: str | None, port: int | None) -> str:
    try:
        return ports.admin_url(admin_url, host, port).rstrip("/")
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _post(url: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, data=b"", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # nosec B310  # http(s): ports.admin_url
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("error", "")
        except ValueError:
            detail = ""
        typer.echo(f"error: {url} answered {exc.code}: {detail or exc.reason}", err=True)
    except (urllib.error.URLError, OSError) as exc:
        typer.echo(
            f"error: cannot reach the admin API at {url} ({getattr(exc, 'reason', exc)}); is this the "
            "server's admin address (its HTTP port + 2 unless it set --admin-port: pass --port or --admin-url)?",
            err=True,
        )
    raise typer.Exit(1)


def drain(
    worker_id: Annotated[str, typer.Argument(help="Worker id, as `inferd status` lists it.")],
    admin_url: AdminUrl = None,
    host: Host = None,
    port: Port = None,
    token: Token = None,
) -> None:
    """Drain a worker: it takes no new batches, finishes what it holds, exits and is replaced."""
    base = _base(admin_url, host, port)
    where = urllib.parse.quote(worker_id, safe="")  # a pool model server's id holds a '/'
    typer.echo(json.dumps(_post(f"{base}/admin/workers/{where}/drain", token, 10.0)))


def scale(
    model: Annotated[str, typer.Argument(help="Model name.")],
    workers: Annotated[int, typer.Option(help="Local workers wanted; extra ones are drained first.")],
    version: Annotated[
        int | None, typer.Option(help="The served version to scale (default: the default version).")
    ] = None,
    admin_url: AdminUrl = None,
    host: Host = None,
    port: Port = None,
    token: Token = None,
) -> None:
    """Set a model's number of local workers (batch and LLM models)."""
    base = _base(admin_url, host, port)
    query = f"workers={workers}" + (f"&version={version}" if version is not None else "")
    typer.echo(json.dumps(_post(f"{base}/admin/models/{model}/scale?{query}", token, 30.0)))


def update(
    model: Annotated[str, typer.Argument(help="Model name.")],
    version: Annotated[
        int | None,
        typer.Option(
            help="The version to roll to, lower ones included (rollback); one already served side by side "
            "becomes the default at once (default: the repository's highest)."
        ),
    ] = None,
    admin_url: AdminUrl = None,
    host: Host = None,
    port: Port = None,
    token: Token = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the whole rolling update.")] = 600.0,
) -> None:
    """Roll a model to another version, worker by worker: the new version's workers start beside the old
    ones, the default flips once one is ready, then the old ones drain (no request fails)."""
    base = _base(admin_url, host, port)
    query = f"?version={version}" if version is not None else ""
    typer.echo(json.dumps(_post(f"{base}/admin/models/{model}/update{query}", token, timeout)))
