"""The `[cluster]` table: where the front ends of one server keep their shared state (cluster/store.py).
Importing this module registers the table.

Which store a front end uses (`open_store`):
- `[cluster] store` (or `inferd serve --store URL`), else `[gateway] redis_url` when that is set: Redis
  (cluster/redis_store.py), for front ends on any hosts. Its password comes only from the environment,
  INFERD_STORE_PASSWORD: a password inside the URL is refused, with the fix. With `--frontends N` too,
  every front end talks to Redis directly (the parent's local store then stands unused).
- else, with `--frontends N`: the parent's store over its private Unix socket (cluster/local.py);
- else none: one front end keeps its state itself.

A Redis store that fails a PING (no answer within `timeout_ms`, a wrong password, a certificate not
trusted) when the server starts is refused, with the fix.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from inferd.cluster.redis_store import without_password
from inferd.cluster.store import Store, StoreError
from inferd.config import ConfigError, ServerConfig, register_table

PASSWORD_ENV = "INFERD_STORE_PASSWORD"  # nosec B105  # the variable's name, not a password
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
SCHEMES = ("redis", "rediss")


def check_store_url(url: str, where: str) -> str:
    """`url` as a store URL: redis:// or rediss://, a host, no password (ValueError with the fix)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError as exc:
        raise ValueError(f"{where} {url!r} is not a URL ({exc}): use redis://HOST:PORT/DB") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(
            f"{where} {url!r} must be redis://HOST:PORT/DB or rediss://HOST:PORT/DB (TLS), "
            f"not {parts.scheme or 'a URL without a scheme'}://"
        )
    if parts.password is not None:
        raise ValueError(
            f"{where} must not hold the password: remove it from the URL and set {PASSWORD_ENV} in the "
            "environment"
        )
    if not parts.hostname:
        raise ValueError(f"{where} {url!r} names no host: use redis://HOST:PORT/DB")
    return url


class ClusterConfig(BaseModel):
    """The `[cluster]` table."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    store: str | None = None
    """The shared store, redis://HOST:PORT/DB or rediss://HOST:PORT/DB (TLS); the password from the
    environment (INFERD_STORE_PASSWORD). None: `[gateway] redis_url` when that is set, else none (one
    front end; with --frontends N, the parent's own store)."""
    name: str = "inferd"
    """This server's name in the store: every key starts with {NAME}, so several servers share one Redis."""
    timeout_ms: int = Field(default=1000, ge=1, le=60_000)
    """A store call not answered within this long fails (StoreUnavailable; at start: refused)."""
    lease_ttl_s: float = Field(default=5.0, gt=0.0, le=600.0)
    """How long a lease holder acts without renewing: after its death, the longest wait for another."""
    tls_ca_file: Path | None = None
    """The CA bundle (PEM) that verifies a rediss:// store (default: the system's)."""
    overprovisioning: float = 1.4
    """Zone routing (routing/locality.py), Envoy's factor: a front end with a zone keeps a model's work in
    its zone while overprovisioning x its zone's healthy share of the zone's workers is at least 1, and
    spills the rest to the other zones. At least 1 (1: spill as soon as one local worker is unhealthy)."""

    @field_validator("store")
    @classmethod
    def _store(cls, url: str | None) -> str | None:
        return None if url is None else check_store_url(url, "[cluster] store")

    @field_validator("overprovisioning")
    @classmethod
    def _overprovisioning(cls, factor: float) -> float:
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(
                f"[cluster] overprovisioning {factor} is below 1: a zone would give away work while all its "
                "workers are healthy. Set it to 1 or more (default 1.4, Envoy's), or remove it"
            )
        return factor

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not NAME.match(name):
            raise ValueError(
                f"[cluster] name {name[:70]!r} must be 1-64 letters, digits, '_', '.' or '-', starting "
                "with a letter or digit (it prefixes the store's keys)"
            )
        return name


register_table("cluster", ClusterConfig)


def cluster_config(config: ServerConfig) -> ClusterConfig:
    table: ClusterConfig = config.table("cluster")
    return table


def with_store(config: ServerConfig, url: str) -> ServerConfig:
    """`config` with `inferd serve --store URL` over the file's `[cluster] store` (ConfigError with the fix)."""
    try:
        check_store_url(url, "--store")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    table = cluster_config(config).model_copy(update={"store": url})
    return config.model_copy(update={"tables": {**config.tables, "cluster": table}})


def store_url(config: ServerConfig) -> str | None:
    """The Redis store's URL: `[cluster] store`, else the file's `[gateway] redis_url` (as the gateway
    uses it), else None."""
    cluster = cluster_config(config)
    if cluster.store is not None:
        return cluster.store
    gateway: Any = config.tables.get("gateway")
    url: str | None = getattr(gateway, "redis_url", None)
    return url


def store_password(environ: Mapping[str, str] = os.environ) -> str | None:
    """The store's password (INFERD_STORE_PASSWORD), None when unset."""
    return environ.get(PASSWORD_ENV) or None


def check_cluster(config: ServerConfig) -> None:
    """Before start: a Redis store needs the redis package (ConfigError with the fix)."""
    url = store_url(config)
    if url is not None and cluster_config(config).store is None:  # [gateway] redis_url, by default
        try:
            check_store_url(url, "[gateway] redis_url (the cluster store, unless [cluster] store is set)")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if url is not None and importlib.util.find_spec("redis") is None:
        raise ConfigError(
            f"the cluster store {without_password(url)} needs the redis package: install inferd with the redis extra "
            "(pip install 'inferd[redis]')"
        )


async def open_store(
    config: ServerConfig, local_path: str | None = None, local_token: str = "",
    environ: Mapping[str, str] = os.environ,
) -> Store | None:
    """The store this front end shares (see the module's doc); `local_path`/`local_token`: the parent's
    store of --frontends N (FrontendPlan.store_path(), its token). None: no store. A Redis store that fails
    a PING is refused: ConfigError with the fix."""
    cluster = cluster_config(config)
    timeout_s = cluster.timeout_ms / 1000
    url = store_url(config)
    if url is None:
        if local_path is None:
            return None
        from inferd.cluster.local import LocalStoreClient

        return LocalStoreClient(local_path, local_token, timeout_s)
    from inferd.cluster.redis_store import RedisStore

    store = RedisStore(url, cluster.name, timeout_s, store_password(environ), cluster.tls_ca_file)
    try:
        await store.ping()
    except StoreError as exc:
        await store.close()
        raise ConfigError(
            f"the cluster store failed its PING at start (timeout {cluster.timeout_ms} ms): {exc}. Start it "
            "or fix [cluster] store / --store (default: [gateway] redis_url); set "
            f"{PASSWORD_ENV} if it needs a password, [cluster] tls_ca_file for a rediss:// store's CA, "
            "or raise [cluster] timeout_ms"
        ) from None
    return store
