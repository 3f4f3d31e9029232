"""Tenants as the config file declares them: `[tenants.NAME]` tables (registered by gateway/config.py).

A tenant is identified by its API keys (stored only as SHA-256 digests), may call only the models it
lists, and carries its share (`weight`) and its limits. The authenticated tenant of a call is
`call.tenant` (a core/tenant.py `Tenant`), set by the Auth layer; layers after it (quotas, cache,
fairness) and the handlers read it from there. With no tenant configured nothing is enforced, and a
call's tenant is the anonymous one its edge made (the HTTP edge: from X-Tenant).

Kept apart from the gateway (it imports only pydantic) so the request core can name a tenant's config.
"""

from __future__ import annotations

import re
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, field_validator

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class KeyDigest(BaseModel):
    """One key as `{ sha256 = "<hex>", expires = 2027-01-01T00:00:00Z }` (a bare hex string is a key that
    never expires)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sha256: str
    expires: datetime | None = None


class TenantConfig(BaseModel):
    """One `[tenants.NAME]` table."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_key_sha256: tuple[str | KeyDigest, ...] = ()
    """Lowercase hex SHA-256 of each key's UTF-8 bytes (`inferd keys new TENANT` prints a key and its
    line); keys are never stored in clear. Two keys at once allow rotation."""
    models: tuple[str, ...] = ()
    """The models this tenant may call (empty: every model); anything else is a 403."""
    weight: float = Field(default=1.0, gt=0.0, le=1_000_000.0)
    """Share of queue room and batch slots against other tenants in the same priority class."""
    requests_per_s: float | None = Field(default=None, gt=0.0)
    """Sustained request rate (a token bucket; None: unlimited)."""
    burst: int | None = Field(default=None, ge=1)
    """Requests allowed at once above the rate (None: one second's worth)."""
    tokens_per_min: int | None = Field(default=None, ge=1)
    """LLM tokens per minute, reserved at admission as prompt + max_tokens, the unused part refunded."""
    max_concurrency: int | None = Field(default=None, ge=1)
    """Most requests of this tenant in flight at once."""
    model_control: bool = False
    """May load and unload models (POST /v2/repository/models/{m}/load, /unload), as the admin token may."""

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, keys: tuple[str | KeyDigest, ...]) -> tuple[str | KeyDigest, ...]:
        for number, key in enumerate(keys, 1):
            digest = key if isinstance(key, str) else key.sha256
            if not _HEX64.match(digest):  # not echoed: it may be a key pasted by mistake
                raise ValueError(
                    f"api_key_sha256 entry {number} is not 64 lowercase hex digits: put the SHA-256 of "
                    "the key there (`inferd keys new TENANT` prints the line), never the key"
                )
        return keys
