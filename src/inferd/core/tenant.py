"""The authenticated caller of a request: `Call.tenant`, set by the Auth layer (gateway/auth.py) from the
key the caller sent. Its config is the `[tenants.NAME]` table (config/tenants.py)."""

from __future__ import annotations

from dataclasses import dataclass

from inferd.config.tenants import TenantConfig


@dataclass(frozen=True, slots=True)
class Tenant:
    """The authenticated caller of one request."""

    name: str
    config: TenantConfig

    def may_call(self, model: str) -> bool:
        return not self.config.models or model in self.config.models
