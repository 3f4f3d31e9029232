"""Where a server's ports are: the default port rule, seen from both sides.

`inferd serve` puts its gRPC API on the HTTP port + 1 and its admin API on the HTTP port + 2 unless
--grpc-port and --admin-port say otherwise (inferd.config.ports), so two servers on one host with HTTP
ports at least 3 apart never clash, and the tools (`inferd status`, `drain`, `scale`, `update`) find a
server's admin API from its HTTP address alone. Before starting, `inferd serve` checks that its ports
are free and names the fix if not.
"""

from __future__ import annotations

import errno
import socket

from inferd.config import ConfigError, ServerConfig, admin_port_for
from inferd.config.ports import PORTS_APART

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

APART = f"servers on one host need HTTP ports at least {PORTS_APART} apart (gRPC on + 1, admin on + 2)"
"""What the port check's messages say about running several servers on one host."""


def admin_url(explicit: str | None, host: str | None, port: int | None) -> str:
    """The admin API's base URL: --admin-url as given, else http://HOST:(PORT + 2) of the server's HTTP
    address (127.0.0.1:8000 by default, so 8002)."""
    if explicit is not None:
        if host is not None or port is not None:
            raise ConfigError(
                "pass either --admin-url or --host/--port (the server's HTTP address), not both"
            )
        if not explicit.lower().startswith(("http://", "https://")):  # urlopen would also read file:// URLs
            raise ConfigError(f"--admin-url {explicit!r} is not an http:// or https:// URL")
        return explicit
    http_port = DEFAULT_PORT if port is None else port
    if http_port == 0:
        raise ConfigError(
            "--port 0 names no server: a server started with --port 0 logs its admin API's address "
            "('admin API on http://...'); pass that as --admin-url"
        )
    return f"http://{host or DEFAULT_HOST}:{admin_port_for(http_port)}"


def check_ports_free(cfg: ServerConfig) -> None:
    """Fail before anything starts when the HTTP, gRPC or admin port is taken (or two of them are one
    port), saying what to change."""
    _check_distinct(cfg)
    if cfg.port != 0 and _in_use(cfg.host, cfg.port):
        raise ConfigError(
            f"HTTP port {cfg.port} on {cfg.host} is in use (another inferd serve, or the gRPC or admin API "
            f"of one on its HTTP port + 1 or + 2?): pass another --port; {APART}"
        )
    if cfg.grpc_port is not None and cfg.grpc_port != 0 and _in_use(cfg.host, cfg.grpc_port):
        why = f" (the HTTP port {cfg.port} + 1)" if "grpc_port" not in cfg.model_fields_set else ""
        raise ConfigError(
            f"gRPC port {cfg.grpc_port}{why} on {cfg.host} is in use: pass --grpc-port PORT (0: a free one), "
            f"or --no-grpc, or another --port; {APART}"
        )
    if cfg.admin_port is not None and cfg.admin_port != 0 and _in_use(cfg.admin_host, cfg.admin_port):
        why = f" (the HTTP port {cfg.port} + 2)" if "admin_port" not in cfg.model_fields_set else ""
        raise ConfigError(
            f"admin port {cfg.admin_port}{why} on {cfg.admin_host} is in use: pass --admin-port PORT "
            f"(0: a free one), or --no-admin, or another --port; {APART}"
        )


def _check_distinct(cfg: ServerConfig) -> None:
    """Two APIs set to one fixed port (the HTTP and gRPC APIs share --host; the admin API may have a
    host of its own, but one port for two listeners is a mistake either way)."""
    named = [("HTTP", cfg.port), ("gRPC", cfg.grpc_port), ("admin", cfg.admin_port)]
    fixed = [(api, port) for api, port in named if port]  # None (off) and 0 (a free one) never clash
    fixes = {"gRPC": "--grpc-port PORT or --no-grpc", "admin": "--admin-port PORT or --no-admin"}
    for i, (api, port) in enumerate(fixed):
        for other, other_port in fixed[i + 1 :]:
            if port == other_port:
                fix = " or ".join(fixes[a] for a in (api, other) if a in fixes)
                raise ConfigError(
                    f"the {api} port and the {other} port are both {port}: pass {fix} (by default gRPC is "
                    "on the HTTP port + 1 and the admin API on + 2)"
                )


def _in_use(host: str, port: int) -> bool:
    """Whether binding host:port fails with 'address in use', as the server's own bind would (both set
    SO_REUSEADDR, so only a listening socket counts, not connections in TIME_WAIT)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror:
        return False  # an unresolvable host is the server's bind to report
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False
