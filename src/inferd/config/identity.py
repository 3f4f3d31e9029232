"""Who a front end and a worker are in a fleet: the zone each is in (a label for now; routing by zone
comes later) and a front end's id (its HTTP `HOST:PORT`, or `--frontend-id`).

`ServerConfig` inherits `IdentitySettings`, so `zone` and `frontend_id` are plain `[server]` keys; the
worker checks its `--zone` with the same rule (`check_zone`)."""

from __future__ import annotations

import re
from typing import Protocol

from pydantic import BaseModel, ConfigDict, field_validator

ZONE_RULE = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
"""A zone is a DNS label (as Kubernetes topology zone values are, lowercased)."""
_ZONE = re.compile(ZONE_RULE)
FRONTEND_ID_MAX_CHARS = 128


def check_zone(zone: str) -> str:
    """The zone, or ValueError naming the rule it breaks."""
    if not _ZONE.fullmatch(zone):
        raise ValueError(
            f"zone {zone!r} is not a DNS label: 1 to 63 characters of a-z, 0-9 and '-', starting and ending "
            f"with a letter or digit ({ZONE_RULE}); e.g. 'us-east-1a'"
        )
    return zone


def check_frontend_id(frontend_id: str) -> str:
    """The front end id, or ValueError naming the rule it breaks."""
    if not frontend_id or len(frontend_id) > FRONTEND_ID_MAX_CHARS:
        raise ValueError(
            f"front end id {frontend_id!r} must be 1 to {FRONTEND_ID_MAX_CHARS} characters "
            f"(it has {len(frontend_id)})"
        )
    if not frontend_id.isprintable() or any(c.isspace() for c in frontend_id):
        raise ValueError(
            f"front end id {frontend_id!r} must be printable characters without whitespace, e.g. 'fe-1' "
            "or 'host-a:8000'"
        )
    return frontend_id


class IdentitySettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    zone: str | None = None
    """The zone this front end runs in (`--zone`), a DNS label: its work stays in this zone first
    (routing/locality.py) and its local workers are started in it; shown by the admin API (GET
    /admin/workers' `frontend`). None: no zone."""
    frontend_id: str | None = None
    """This front end's id in a fleet of front ends (`--frontend-id`); None: the `HOST:PORT` of its HTTP
    listener (`frontend_id()`). Printable, no whitespace, at most 128 characters."""

    def zone_args(self) -> list[str]:
        """The local workers' `--zone`: this front end's."""
        return ["--zone", self.zone] if self.zone else []

    @field_validator("zone")
    @classmethod
    def _zone(cls, v: str | None) -> str | None:
        return None if v is None else check_zone(v)

    @field_validator("frontend_id")
    @classmethod
    def _frontend_id(cls, v: str | None) -> str | None:
        return None if v is None else check_frontend_id(v)


class _Listening(Protocol):
    frontend_id: str | None
    host: str
    port: int


def frontend_id(config: _Listening) -> str:
    """A front end's id (`config`: a ServerConfig): `--frontend-id`, else the `HOST:PORT` of its HTTP
    listener (with port 0, pass --frontend-id: the port is not known before it binds). Two live front
    ends with one id are refused by the shared store (cluster/)."""
    return config.frontend_id or f"{config.host}:{config.port}"


EVERY_ADDRESS = frozenset({"", "0.0.0.0", "::", "[::]"})  # nosec B104 - recognizes a wildcard, binds nothing
"""Hosts a listener binds to listen on every address: nobody can connect to them from another host."""


class _Administered(_Listening, Protocol):
    admin_host: str
    admin_port: int | None


def admin_address(config: _Administered) -> str | None:
    """Where the other front ends reach this one's admin API (its record in the shared store: a change
    asked of a front end that does not decide is forwarded there): `--admin-host`, or, when that listens
    on every address, the host of the front end's id (`--frontend-id POD_IP:PORT` on Kubernetes). None:
    no admin API. ValueError, with the fix, when neither names a host others can reach, or the port is
    0 (not known before it binds)."""
    if config.admin_port is None:
        return None
    host = config.admin_host
    if host in EVERY_ADDRESS:
        host = frontend_id(config).rpartition(":")[0]
    if host in EVERY_ADDRESS or config.admin_port == 0:
        raise ValueError(
            f"the admin API listens on {config.admin_host or '*'}:{config.admin_port}, which the other front "
            "ends of a shared store cannot reach to forward changes to it: give --admin-host (or "
            "--frontend-id HOST:PORT) an address they reach, and a fixed --admin-port"
        )
    return f"{host}:{config.admin_port}"
