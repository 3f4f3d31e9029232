"""The gateway's tables in the config file: `[gateway]` (GatewayConfig) and `[tenants.NAME]` (one
TenantConfig each, config/tenants.py). Importing this module registers both tables."""

from __future__ import annotations

import re
from collections.abc import Iterable

from pydantic import ConfigDict, Field, RootModel, field_validator

from inferd.config import ConfigError, ServerConfig, register_table
from inferd.config.tenants import TenantConfig
from inferd.gateway.quota_store import QuotaSettings

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


class GatewayConfig(QuotaSettings):
    """The `[gateway]` table: the quota store's settings (QuotaSettings) and the ones below."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metrics_require_key: bool = False
    """With tenants configured, /metrics needs an API key too (default: open, like the health routes)."""


class TenantsTable(RootModel[dict[str, TenantConfig]]):
    """Every `[tenants.NAME]` table: tenant name -> its settings."""

    model_config = ConfigDict(frozen=True)

    root: dict[str, TenantConfig] = Field(default_factory=dict)

    @field_validator("root")
    @classmethod
    def _names(cls, tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        for name in tenants:
            if not TENANT_NAME.match(name):
                raise ValueError(
                    f"tenant name {name[:70]!r} must be 1-64 letters, digits, '_', '.' or '-', "
                    "starting with a letter or digit: rename the [tenants.NAME] table"
                )
        return tenants


register_table("gateway", GatewayConfig)
register_table("tenants", TenantsTable)


def gateway_config(config: ServerConfig) -> GatewayConfig:
    table: GatewayConfig = config.table("gateway")
    return table


def tenants_of(config: ServerConfig) -> dict[str, TenantConfig]:
    table: TenantsTable = config.table("tenants")
    return dict(table.root)


def check_tenants(tenants: dict[str, TenantConfig], served: Iterable[str]) -> None:
    """Every model a tenant lists is served: else a ConfigError naming the served ones."""
    served_names = sorted(set(served))
    for name, tenant in tenants.items():
        unknown = sorted(set(tenant.models) - set(served_names))
        if unknown:
            raise ConfigError(
                f"[tenants.{name}] models lists {unknown}, which are not served; served models: "
                f"{served_names} (fix the list, or serve those models)"
            )
