"""Where a server's ports are: the admin port rule, seen from both sides.

`inferd serve` puts its admin API on the HTTP port + 1 unless --admin-port says otherwise
(inferd.config.admin_port_for), so two servers on one host with HTTP ports at least 2 apart never clash,
and the tools (`inferd status`, `drain`, `scale`, `update`) find a server's admin API from its HTTP
address alone. Before starting, `inferd serve` checks that its ports are free and names the fix if not.
"""

from __future__ import annotations

import errno
import socket

from inferd.config import ConfigError, ServerConfig, admin_port_for

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def admin_url(explicit: str | None, host: str | None, port: int | None) -> str:
    """The admin API's base URL: --admin-url as given, else http://HOST:(PORT + 1) of the server's HTTP
    address (127.0.0.1:8000 by default)."""
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
    """Fail before anything starts when the HTTP or admin port is taken, saying what to change."""
    if cfg.admin_port is not None and cfg.admin_port != 0 and cfg.admin_port == cfg.port:
        raise ConfigError(
            f"the admin port and the HTTP port are both {cfg.port}: pass another --admin-port, or --no-admin"
        )
    if cfg.port != 0 and _in_use(cfg.host, cfg.port):
        raise ConfigError(
            f"HTTP port {cfg.port} on {cfg.host} is in use (another inferd serve, or its admin API on its "
            f"HTTP port + 1?): pass another --port; servers on one host need HTTP ports at least 2 apart"
        )
    if cfg.admin_port is not None and cfg.admin_port != 0 and _in_use(cfg.admin_host, cfg.admin_port):
        derived = "admin_port" not in cfg.model_fields_set
        why = f" (the HTTP port {cfg.port} + 1)" if derived else ""
        raise ConfigError(
            f"admin port {cfg.admin_port}{why} on {cfg.admin_host} is in use: pass --admin-port PORT "
            "(0: a free one), or --no-admin, or choose a --port whose next port is free"
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
