"""`inferd.worker.main`'s command line: how every worker is started, wherever it runs (worker/launcher.py
builds these arguments)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from inferd.config.identity import check_zone
from inferd.worker.discovery import RESOLVE_EVERY_S
from inferd.worker.stuck import STUCK_AFTER_S, positive_seconds


def zone(value: str) -> str:
    try:
        return check_zone(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferd-worker", description="Run one inferd worker (one device).")
    parser.add_argument(
        "--connect",
        required=True,
        help="front end address: unix:/path, HOST:PORT or dns:NAME:PORT (every address NAME has, looked "
        "up again every few seconds); several, comma-separated, share the worker",
    )
    parser.add_argument("--zone", type=zone, default=None, help="the zone this worker runs in (a DNS label)")
    parser.add_argument(
        "--hosts-file",
        type=Path,
        default=None,
        help="resolve dns: names from this /etc/hosts-format file, read at each lookup (tests, hosts "
        "without DNS)",
    )
    parser.add_argument(
        "--resolve-every-s",
        type=positive_seconds,
        default=RESOLVE_EVERY_S,
        help="look each dns: name up again this often",
    )
    serves = parser.add_mutually_exclusive_group(required=True)
    serves.add_argument("--model", help="name of the model this worker serves")
    serves.add_argument(
        "--pool",
        help="serve the models of this pool ([pools.NAME]) instead: they are loaded and unloaded on demand, "
        "within the pool's memory budget (worker/pool.py)",
    )
    parser.add_argument(
        "--token", default=os.environ.get("INFERD_JOIN_TOKEN", ""),
        help="join token, if the front end requires one (default: INFERD_JOIN_TOKEN in the environment)",
    )
    parser.add_argument("--worker-id", default="", help="worker id (default: random)")
    parser.add_argument("--reconnect", action="store_true", help="rejoin lost front ends (remote workers)")
    parser.add_argument(
        "--model-repo",
        type=Path,
        default=None,
        help="this host's copy of the model repository (for models served from one)",
    )
    parser.add_argument(
        "--model-version",
        type=int,
        default=0,
        help="the model version to serve, when several are served side by side (default: the default one)",
    )
    parser.add_argument(
        "--ca-file",
        type=Path,
        default=None,
        help="join over TLS, verifying the front end against this CA (PEM)",
    )
    parser.add_argument("--ca-pem", default="", help="the same CA as PEM text (Ray actors)")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow plain TCP to a front end that is not on loopback (it needs --insecure too)",
    )
    parser.add_argument(
        "--stuck-after-s",
        type=positive_seconds,
        default=STUCK_AFTER_S,
        help="cut off front ends stuck this long",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--trace-endpoint", default=None, help="export spans to this OTLP/HTTP collector")
    parser.add_argument("--service-name", default=None, help="service.name of the spans (OTEL_SERVICE_NAME)")
    return parser
