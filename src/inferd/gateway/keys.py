"""API keys: making one (`inferd keys new`), and the directory that finds a key's tenant.

A key is stored only as the lowercase hex SHA-256 of its UTF-8 bytes. The directory compares the digest
of a presented key with every stored digest in constant time (hmac.compare_digest, no early exit), so
neither a match nor a near-match shows in the time taken. No I/O; the wall clock (for expiry) is
injected.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC
from enum import Enum

from inferd.config import ConfigError
from inferd.config.tenants import KeyDigest, TenantConfig
from inferd.core.tenant import Tenant

KEY_PREFIX = "ik-"
"""Every key `inferd keys new` makes starts with this, so a leaked key is easy to recognize."""


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    """What `api_key_sha256` holds for `key`."""
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStatus(Enum):
    OK = "ok"
    MISSING = "missing"
    UNKNOWN = "unknown"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class KeyCheck:
    """The directory's answer for one presented key: its tenant when `status` is OK."""

    status: KeyStatus
    tenant: Tenant | None = None


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes
    tenant: Tenant
    expires_at: float | None
    """Wall-clock seconds (Unix time) from which the key is refused; None: never."""


def _expiry(key: str | KeyDigest) -> tuple[str, float | None]:
    if isinstance(key, str):
        return key, None
    if key.expires is None:
        return key.sha256, None
    when = key.expires if key.expires.tzinfo else key.expires.replace(tzinfo=UTC)  # TOML local time: UTC
    return key.sha256, when.timestamp()


class KeyDirectory:
    """Key digest -> tenant, built from the `[tenants.NAME]` tables. `wall_now` gives Unix time."""

    def __init__(self, tenants: Mapping[str, TenantConfig], wall_now: Callable[[], float]) -> None:
        self.wall_now = wall_now
        self.tenants = {name: Tenant(name, config) for name, config in tenants.items()}
        entries: list[_Entry] = []
        owners: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            for key in tenant.config.api_key_sha256:
                digest, expires_at = _expiry(key)
                if digest in owners and owners[digest] != name:
                    raise ConfigError(
                        f"one key digest ({digest[:12]}...) is listed by tenants {owners[digest]!r} and "
                        f"{name!r}: a key identifies one tenant; make a new key for one of them"
                    )
                owners[digest] = name
                entries.append(_Entry(bytes.fromhex(digest), tenant, expires_at))
        self._entries = tuple(entries)

    def __len__(self) -> int:
        """How many keys (digests) are known."""
        return len(self._entries)

    def check(self, key: str | None) -> KeyCheck:
        """The tenant of `key`, or why there is none (missing, unknown, expired)."""
        if not key:
            return KeyCheck(KeyStatus.MISSING)
        presented = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found: _Entry | None = None
        for entry in self._entries:  # every entry, always: the time taken does not depend on the match
            if hmac.compare_digest(entry.digest, presented):
                found = entry
        if found is None:
            return KeyCheck(KeyStatus.UNKNOWN)
        if found.expires_at is not None and self.wall_now() >= found.expires_at:
            return KeyCheck(KeyStatus.EXPIRED)
        return KeyCheck(KeyStatus.OK, found.tenant)
