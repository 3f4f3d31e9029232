"""`inferd serve`, `inferd bench` and `inferd bench-llm`."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Annotated

import typer

from inferd.cli.observability_flags import (
    AccessLogSample,
    LogFormat,
    TraceEndpoint,
    TraceSample,
    observability_settings,
)
from inferd.cli.ports import check_ports_free
from inferd.cluster.config import check_cluster, store_password, with_store  # registers [cluster] too
from inferd.config import ConfigError, ModelConfig, ServerConfig, identity, load_server_config
from inferd.config.pools import pool_refusals
from inferd.data_lock import hold_data_dir
from inferd.gateway.reload import build_gate  # also registers the [gateway] and [tenants.NAME] tables
from inferd.observability.logging_setup import set_up_process
from inferd.tls import check_server_tls

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="inferd: an inference server with dynamic batching, bounded queues and deadlines.",
)


def check_models(models: list[ModelConfig]) -> None:
    """Every model's kind is known, its typed params and [autoscale] fit it, its traffic table names
    served versions, and its traffic.fallback names a served model of a kind that serves its routes:
    refused before start."""
    from inferd.fleet.scaling import check_autoscalable
    from inferd.gateway.fallback import check_fallbacks
    from inferd.gateway.traffic_control import check_traffic
    from inferd.server import builtin_kinds

    kinds = builtin_kinds()
    for m in models:
        kind = kinds.check(m)
        if m.autoscale is not None:
            try:
                check_autoscalable(kind)
            except ConfigError as exc:
                raise ConfigError(f"model {m.name!r}: {exc}") from None
    check_traffic(models)
    check_fallbacks(models, lambda name: {m.kind for m in models if m.name == name}, kinds)


def check_gateway(config: ServerConfig, models: list[ModelConfig]) -> None:
    """Tenants list only served models, no key digest belongs to two tenants, and a model caching in
    Redis has [gateway] redis_url: refused before start."""
    from inferd.gateway.config import gateway_config
    from inferd.gateway.redis_cache import check_cache_stores

    build_gate(config, [m.name for m in models], time.time)
    check_cache_stores(models, gateway_config(config).redis_url)


def resolve_models(config: ServerConfig) -> list[ModelConfig]:
    from inferd.kinds.repository import apply_overrides, default_models, load_repository

    models = load_repository(config.model_repo) if config.model_repo else default_models(config.cache_dir)
    if config.models:
        unknown = sorted(set(config.models) - {m.name for m in models})
        if unknown:
            raise ConfigError(
                f"--model names unknown models {unknown}; available: {sorted(m.name for m in models)}"
            )
        models = [m for m in models if m.name in config.models]
    return apply_overrides(models, config.model_overrides)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on (default: 127.0.0.1).")] = None,
    port: Annotated[
        int | None, typer.Option(help="HTTP port (default: 8000); 0: a free one (logged at start).")
    ] = None,
    model_repo: Annotated[
        Path | None,
        typer.Option(
            help="Model repository folder (one folder per model with model.toml and numbered versions). "
            "Default: the embedded models sim and minilm."
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="TOML config file with [server] settings and [models.NAME] overrides.")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            help="Worker processes (devices) per model, unless a model's config sets its own (default: 1)."
        ),
    ] = None,
    model: Annotated[list[str] | None, typer.Option(help="Serve only this model (repeatable).")] = None,
    frontends: Annotated[
        int | None,
        typer.Option(
            help="Front-end processes sharing the HTTP and gRPC ports (SO_REUSEPORT) and the workers (default: 1); "
            "front end 0 runs the local workers, the admin API and the autoscaler. With --worker-port P, "
            "front end i takes remote workers on P + i."
        ),
    ] = None,
    admin_port: Annotated[
        int | None,
        typer.Option(
            help="Port of the admin API (worker list, drain, restart) (default: the HTTP port + 2, "
            "so 8002 for 8000; a free one, logged at start, with --port 0). "
            "Set INFERD_ADMIN_TOKEN to require a bearer token."
        ),
    ] = None,
    admin_host: Annotated[
        str | None, typer.Option(help="Address of the admin API (default: 127.0.0.1).")
    ] = None,
    no_admin: Annotated[bool, typer.Option("--no-admin", help="Do not serve the admin API.")] = False,
    grpc_port: Annotated[
        int | None,
        typer.Option(
            help="Port of the gRPC API (KServe v2 / Triton's GRPCInferenceService, health, reflection), on "
            "--host (default: the HTTP port + 1, so 8001 for 8000; a free one, logged, with --port 0)."
        ),
    ] = None,
    no_grpc: Annotated[bool, typer.Option("--no-grpc", help="Do not serve the gRPC API.")] = False,
    worker_port: Annotated[
        int | None,
        typer.Option(
            help="TCP port where workers on other hosts join (`inferd worker --connect HOST:PORT`); "
            "needs INFERD_JOIN_TOKEN. Default: local workers only."
        ),
    ] = None,
    worker_host: Annotated[
        str | None, typer.Option(help="Address of the worker port (default: 127.0.0.1).")
    ] = None,
    access_log: Annotated[
        bool | None,
        typer.Option(
            "--access-log/--no-access-log", help="Log one line per request with its lifecycle record."
        ),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="DEBUG, INFO, WARNING or ERROR (default: INFO).")
    ] = None,
    log_format: LogFormat = None,
    access_log_sample: AccessLogSample = None,
    trace_endpoint: TraceEndpoint = None,
    trace_sample: TraceSample = None,
    shutdown_grace_s: Annotated[
        float | None,
        typer.Option(
            help="After SIGTERM, seconds during which /v2/health/ready answers 503 while requests are "
            "still accepted and served (so load balancers stop sending), before the drain "
            "(default: 5); 0: drain at once."
        ),
    ] = None,
    header_timeout_s: Annotated[
        float | None,
        typer.Option(
            help="Total seconds a client has to send a request head (from connect, or from the first "
            "byte of the next request on a keep-alive connection) before 408 and close (default: 10)."
        ),
    ] = None,
    max_connections: Annotated[
        int | None,
        typer.Option(help="Most open connections; the next ones get 429 and are closed (default: 4096)."),
    ] = None,
    max_connections_per_ip: Annotated[
        int | None,
        typer.Option(
            help="Most open connections from one client address; the next ones get 429 and are "
            "closed (default: 2048). Behind a proxy, raise it to --max-connections."
        ),
    ] = None,
    admission_rate_per_s: Annotated[
        float | None,
        typer.Option(
            help="Requests per second let through to the app; the excess gets 429 with Retry-After "
            "as soon as its head is parsed (default: no limit)."
        ),
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Run the workers as Ray actors on this running Ray cluster (HOST:PORT, auto, or local "
            "for a new one-node cluster); needs inferd[ray]. Each actor holds one GPU, or one "
            "inferd_device resource on a cluster without GPUs.",
        ),
    ] = None,
    ray_resource: Annotated[
        str | None,
        typer.Option(
            help="Ray resource each worker actor holds one of (default: GPU if the cluster has any, else inferd_device)."
        ),
    ] = None,
    ssl_certfile: Annotated[
        Path | None,
        typer.Option(
            help="PEM certificate (chain): the HTTP and admin APIs (and the worker port) speak TLS >= 1.2 only."
        ),
    ] = None,
    ssl_keyfile: Annotated[Path | None, typer.Option(help="PEM private key of --ssl-certfile.")] = None,
    worker_ssl_certfile: Annotated[
        Path | None,
        typer.Option(
            help="PEM certificate of the worker port (default: --ssl-certfile); it must name the address "
            "workers connect to as a subjectAltName."
        ),
    ] = None,
    worker_ssl_keyfile: Annotated[
        Path | None, typer.Option(help="PEM private key of --worker-ssl-certfile.")
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where search indexes keep their data (default: $XDG_DATA_HOME/inferd or "
            "~/.local/share/inferd)."
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            help="The store front ends on many hosts share their served state in: redis://HOST:PORT/DB "
            "or rediss:// (TLS); its password from INFERD_STORE_PASSWORD, never the URL (default: "
            "[cluster] store, else [gateway] redis_url). Front ends with the same --store, model "
            "repository and INFERD_JOIN_TOKEN form one server; with --frontends N each talks to it.",
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Let workers join over plain TCP on a --worker-host that is not loopback (a trusted "
            "network only; the workers need --insecure too).",
        ),
    ] = False,
    zone: Annotated[
        str | None,
        typer.Option(help="The zone this front end runs in, a DNS label (e.g. us-east-1a); a label for now."),
    ] = None,
    frontend_id: Annotated[
        str | None,
        typer.Option(help="This front end's id among the front ends of one server (default: HOST:PORT)."),
    ] = None,
) -> None:
    """Serve models over HTTP (KServe OIP v2 and OpenAI-compatible embeddings).

    gRPC listens on the HTTP port + 1 and the admin API on the HTTP port + 2 unless --grpc-port and
    --admin-port say otherwise (8000 -> 8001 and 8002, as Triton), so servers on one host need HTTP ports
    at least 3 apart; `inferd status --port 9000` finds the admin API of the server on port 9000 by the
    same rule. A port in use is reported at start with the fix.
    """
    try:
        observe = observability_settings(log_format, access_log_sample, trace_endpoint, trace_sample)
        if access_log_sample is not None and access_log is None:
            access_log = True
        cfg = load_server_config(
            config,
            {
                "host": host,
                "port": port,
                "model_repo": model_repo,
                "workers": workers,
                "frontends": frontends,
                "models": tuple(model) if model else None,
                "access_log": access_log,
                "log_level": log_level,
                "admin_port": admin_port,
                "admin_host": admin_host,
                "grpc_port": grpc_port,
                "worker_port": worker_port,
                "worker_host": worker_host,
                "ray_address": ray,
                "ray_resource": ray_resource,
                "shutdown_grace_s": shutdown_grace_s,
                "ssl_certfile": ssl_certfile,
                "ssl_keyfile": ssl_keyfile,
                "worker_ssl_certfile": worker_ssl_certfile,
                "worker_ssl_keyfile": worker_ssl_keyfile,
                "insecure": True if insecure else None,
                "header_timeout_s": header_timeout_s,
                "max_connections": max_connections,
                "max_connections_per_ip": max_connections_per_ip,
                "admission_rate_per_s": admission_rate_per_s,
                "observability": observe,
                "data_dir": data_dir,
                "zone": zone,
                "frontend_id": frontend_id,
            },
        )
        if no_admin:
            cfg = cfg.model_copy(update={"admin_port": None})
        if no_grpc:
            cfg = cfg.model_copy(update={"grpc_port": None})
        if store is not None:
            cfg = with_store(cfg, store)
        check_cluster(cfg)
        if cfg.ray_address and cfg.frontends > 1:
            raise ConfigError("--ray runs with one front end: drop --frontends (or set it to 1)")
        if cfg.ray_address and importlib.util.find_spec("ray") is None:
            raise ConfigError("--ray (ray_address) needs Ray: pip install 'inferd[ray]'")
        models = resolve_models(cfg)
        check_models(models)
        check_gateway(cfg, models)
        if refusals := pool_refusals(models, cfg.pools):  # an unknown pool, a model over its budget
            raise ConfigError(refusals[0])
        check_ports_free(cfg)
        check_server_tls(cfg)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    from inferd.runner import run_server  # imports the server: only once the config is known good

    secrets = [s.get_secret_value() for s in (cfg.join_token, cfg.admin_token) if s is not None]
    secrets += [p for p in (store_password(),) if p is not None]
    set_up_process(cfg.observability, cfg.log_level, "server", secrets)
    try:  # held until this process ends (the parent of --frontends N: its front ends share the folder)
        hold_data_dir(cfg.data_dir, f"{cfg.host}:{cfg.port}", identity.frontend_id(cfg))
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if cfg.frontends > 1:
        from inferd.runner.parent import run_frontends

        run_frontends(cfg, models)
    else:
        run_server(cfg, models)


def _register_tools() -> None:
    from inferd.cli.fleet_cmds import drain, scale, update
    from inferd.cli.fleet_sim import fleet_sim_app
    from inferd.cli.keys import keys_app
    from inferd.cli.slo import slo_app
    from inferd.cli.status import status
    from inferd.cli.top import top
    from inferd.cli.worker_cmd import worker

    app.command("status")(status)
    app.add_typer(fleet_sim_app, name="fleet-sim")
    app.command("worker")(worker)
    app.command("top")(top)
    app.command("drain")(drain)
    app.command("scale")(scale)
    app.command("update")(update)
    app.add_typer(keys_app, name="keys")
    app.add_typer(slo_app, name="slo")
    from inferd.cli.plan_llm import plan_llm_cmd
    from inferd.cli.search_cmds import bench_search, index_app, plan_app

    plan_app.command("llm")(plan_llm_cmd)
    app.add_typer(index_app, name="index")
    app.add_typer(plan_app, name="plan")
    app.command("bench-search")(bench_search)


_register_tools()


def _register_bench() -> None:
    try:
        from inferd.cli.bench_cmd import bench
        from inferd.cli.bench_llm_cmd import bench_llm
    except ImportError:  # the load tool is part of the package; this only guards a broken install
        return
    app.command("bench")(bench)
    app.command("bench-llm")(bench_llm)


_register_bench()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
