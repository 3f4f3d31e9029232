"""Who is calling: `Call.tenant`, always set. With `[tenants.NAME]` configured (config/tenants.py) it is
the tenant the caller's key names, set by the Auth layer (gateway/auth.py); without tenants it is an
anonymous tenant the edge makes (the HTTP edge: from `X-Tenant`, "" when absent). Either way it is the
one tenant of the call: its LLM prefix-cache salt and its fairness lane in every queue."""

from __future__ import annotations

from dataclasses import dataclass

from inferd.config.tenants import TenantConfig

MAX_ANONYMOUS_NAME = 256
"""Longest name a caller may give itself without tenants (X-Tenant)."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """The caller of one request: an authenticated tenant, or an anonymous one."""

    name: str
    config: TenantConfig
    anonymous: bool = False
    """Named by the caller itself (no tenants configured): nothing is enforced on it, and it has no
    quotas, no model list, no response-cache partition and no `inferd_tenant_requests_total` series."""

    def may_call(self, model: str) -> bool:
        return not self.config.models or model in self.config.models


_ANONYMOUS_CONFIG = TenantConfig()
ANONYMOUS = Tenant("", _ANONYMOUS_CONFIG, anonymous=True)
"""The caller that names no tenant."""


def anonymous(name: str | None) -> Tenant:
    """The anonymous tenant a caller names (None or "": `ANONYMOUS`). The edge checks the name's length
    (MAX_ANONYMOUS_NAME) and says what was wrong in its own words."""
    if not name:
        return ANONYMOUS
    return Tenant(name, _ANONYMOUS_CONFIG, anonymous=True)
