"""`inferd worker`: one worker process that joins a router (or several front ends) over TCP."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from inferd.cli.observability_flags import LogFormat, TraceEndpoint
from inferd.worker.stuck import STUCK_AFTER_S


def worker(
    connect: Annotated[
        str,
        typer.Option(
            help="Front end address HOST:PORT (its --worker-port); several, comma-separated, share the "
            "worker; dns:NAME:PORT joins every address NAME has (e.g. a Kubernetes headless Service), "
            "looks it up again every 5 s, joins new ones and leaves those gone."
        ),
    ],
    model: Annotated[str | None, typer.Option(help="Name of the model this worker serves.")] = None,
    pool: Annotated[
        str | None,
        typer.Option(
            help="Serve the models of this pool ([pools.NAME] on the front ends) instead of one model: they "
            "are loaded and unloaded on demand within the pool's memory budget."
        ),
    ] = None,
    token: Annotated[
        str | None, typer.Option(help="Join token; default: the INFERD_JOIN_TOKEN environment variable.")
    ] = None,
    worker_id: Annotated[str | None, typer.Option(help="Worker id (default: HOSTNAME-PID).")] = None,
    model_repo: Annotated[
        Path | None,
        typer.Option(help="This host's copy of the model repository, for models served from one."),
    ] = None,
    model_version: Annotated[
        int | None,
        typer.Option(
            help="The model version to serve when several are served side by side (default: the default one)."
        ),
    ] = None,
    ca_file: Annotated[
        Path | None,
        typer.Option(
            help="Join over TLS, verifying the router's certificate against this CA (PEM); the "
            "certificate must name the --connect host as a subjectAltName."
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Allow plain TCP (the join token in the clear) to a router that is not on loopback; "
            "the router needs --insecure too.",
        ),
    ] = False,
    stuck_after_s: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Cut off a front end that has read nothing this long while the worker has data for it "
            "(stopped, or its network gone): one hung front end never stalls the others.",
        ),
    ] = STUCK_AFTER_S,
    zone: Annotated[
        str | None, typer.Option(help="The zone this worker runs in, a DNS label (e.g. us-east-1a).")
    ] = None,
    hosts_file: Annotated[
        Path | None,
        typer.Option(hidden=True, help="Resolve dns: names from this /etc/hosts-format file (tests, ops)."),
    ] = None,
    resolve_every_s: Annotated[
        float | None, typer.Option(hidden=True, min=0.001, help="Look dns: names up again this often.")
    ] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
    log_format: LogFormat = None,
    trace_endpoint: TraceEndpoint = None,
) -> None:
    """Run one worker (one device) that joins a router over TCP and registers again whenever the
    router restarts: of one model (--model), or of a pool's models (--pool). Stop it with SIGTERM or
    Ctrl-C."""
    import os
    import socket

    from inferd.config.identity import check_zone
    from inferd.worker.main import main as worker_main

    if (model is None) == (pool is None):
        typer.echo("error: pass --model NAME (one model) or --pool NAME (a pool's models), not both", err=True)
        raise typer.Exit(2)
    try:
        if zone is not None:
            check_zone(zone)
    except ValueError as exc:
        typer.echo(f"error: --zone: {exc}", err=True)
        raise typer.Exit(2) from None

    join = token if token is not None else os.environ.get("INFERD_JOIN_TOKEN", "")
    if not join:
        typer.echo("error: no join token: pass --token or set INFERD_JOIN_TOKEN (the router's)", err=True)
        raise typer.Exit(2)
    args = [
        "--connect",
        connect,
        *(["--model", model] if model is not None else ["--pool", str(pool)]),
        "--token",
        join,
        "--reconnect",
        "--log-level",
        log_level,
        "--worker-id",
        worker_id or f"{socket.gethostname()}-{os.getpid()}",
        "--stuck-after-s",
        str(stuck_after_s),
    ]
    if model_repo is not None:
        args += ["--model-repo", str(model_repo)]
    if model_version is not None:
        args += ["--model-version", str(model_version)]
    if ca_file is not None:
        args += ["--ca-file", str(ca_file)]
    if insecure:
        args.append("--insecure")
    if zone is not None:
        args += ["--zone", zone]
    if hosts_file is not None:
        args += ["--hosts-file", str(hosts_file)]
    if resolve_every_s is not None:
        args += ["--resolve-every-s", str(resolve_every_s)]
    args += ["--log-format", log_format or "text"]
    if trace_endpoint:
        args += ["--trace-endpoint", trace_endpoint]
    raise typer.Exit(worker_main(args))
