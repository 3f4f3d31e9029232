"""How the benchmark specs (`LoadSpec`, `LLMLoadSpec`, `ChaosSpec`) validate themselves: named checks,
one `ValueError` that lists every failed one."""

from __future__ import annotations

import re
from urllib.parse import urlsplit


def require(checks: dict[str, bool], spec: object) -> None:
    """Raise `ValueError` naming every check that is False, and the spec."""
    failed = [msg for msg, ok in checks.items() if not ok]
    if failed:
        raise ValueError(f"invalid {type(spec).__name__} ({'; '.join(failed)}): {spec}")


def is_plain_http(url: str) -> bool:
    """An http:// URL with a host and a well-formed port, if any."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError on a malformed port
    except ValueError:
        return False
    return parts.scheme == "http" and bool(parts.hostname)


def is_grpc_target(target: str) -> bool:
    """HOST:PORT (a bracketed IPv6 host too), no scheme: what a gRPC channel is opened to."""
    host, colon, port = target.rpartition(":")
    return bool(colon and host and "/" not in host and port.isdigit() and 0 < int(port) < 65536)


def default_grpc_target(url: str) -> str:
    """The gRPC target of a server whose HTTP API is at `url`: its host, the HTTP port + 1 (inferd's and
    Triton's default); ValueError when `url` has no host."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"no host in {url!r} to derive the gRPC target from: give --grpc-target")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port + 1}"


_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def header_ok(name: str, value: str) -> bool:
    """A header name that is an HTTP token, and a value without CR, LF or NUL (no header injection)."""
    return bool(_TOKEN.match(name)) and not any(c in value for c in "\r\n\0")


def parse_header(raw: str) -> tuple[str, str]:
    """`"Name: value"` as (name, value), both stripped; ValueError when there is no colon or no name (the
    text is not echoed: it may hold a key)."""
    name, colon, value = raw.partition(":")
    if not colon:
        raise ValueError("a --header is 'Name: value': no colon found")
    if not name.strip():
        raise ValueError("a --header is 'Name: value': no name before the colon")
    return name.strip(), value.strip()
