"""How the benchmark specs (`LoadSpec`, `LLMLoadSpec`, `ChaosSpec`) validate themselves: named checks,
one `ValueError` that lists every failed one."""

from __future__ import annotations

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
