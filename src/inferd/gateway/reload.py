"""The gateway's identity settings as one value (`Gate`: tenants, keys, the [gateway] table), and
`Gateway`, which holds the current one and swaps it whole when the config file is re-read (SIGHUP,
POST /admin/reload), together with the served models' traffic and cache tables (gateway/model_reload.py).
The whole file is validated first; a file that fails is refused whole: the running gate, splits and
caches stay. The answer says what changed, and which [models.NAME] settings wait for a restart."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from inferd.config import ConfigError, ServerConfig, load_server_config
from inferd.core.tenant import Tenant
from inferd.gateway.config import GatewayConfig, check_tenants, gateway_config, tenants_of
from inferd.gateway.keys import KeyDirectory
from inferd.gateway.model_reload import ModelSettings
from inferd.gateway.quota_store import TenantQuotas
from inferd.gateway.quotas import check_quota_config
from inferd.gateway.redis_store import open_quota_store

log = logging.getLogger("inferd.gateway")


@dataclass(frozen=True, slots=True)
class Gate:
    """Tenants, their keys and the [gateway] settings, as read from one version of the config file."""

    directory: KeyDirectory
    config: GatewayConfig

    @property
    def enforced(self) -> bool:
        """Any tenant configured: data-plane routes need a key."""
        return bool(self.directory.tenants)

    def summary(self) -> dict[str, Any]:
        """What an operator may see (names and counts; never keys nor digests)."""
        return {
            "tenants": sorted(self.directory.tenants),
            "keys": len(self.directory),
            "gateway": self.config.model_dump(),
        }


def build_gate(
    config: ServerConfig,
    served: Iterable[str],
    wall_now: Callable[[], float],
    context_lengths: Mapping[str, int] | None = None,
) -> Gate:
    """The gate of a validated config; ConfigError when a tenant lists a model that is not served, two
    tenants share a key, or a tenant's tokens_per_min is below the longest request one of its models
    accepts (`context_lengths`: the LLM models' context lengths)."""
    tenants = tenants_of(config)
    check_tenants(tenants, served)
    for name, tenant in tenants.items():
        lengths = [n for model, n in (context_lengths or {}).items() if Tenant(name, tenant).may_call(model)]
        check_quota_config({name: tenant}, max(lengths, default=0))
    return Gate(KeyDirectory(tenants, wall_now), gateway_config(config))


def tenant_changes(old: Gate, new: Gate) -> dict[str, list[str]]:
    """Tenants added, removed, or whose table (keys, limits, models) changed."""
    before, after = old.directory.tenants, new.directory.tenants
    return {
        "added": sorted(set(after) - set(before)),
        "removed": sorted(set(before) - set(after)),
        "changed": sorted(n for n in set(before) & set(after) if before[n].config != after[n].config),
    }


class Gateway:
    """The current gate. `served` lists the served model names (checked against tenants' lists)."""

    def __init__(
        self,
        config: ServerConfig,
        served: Callable[[], list[str]],
        wall_now: Callable[[], float] = time.time,
        context_lengths: Callable[[], Mapping[str, int]] = dict,
        models: ModelSettings | None = None,
    ) -> None:
        self.config_path = config.config_path
        self.models = models
        """The served models' live tables (traffic, cache); None: a reload leaves the models alone."""
        self.served = served
        self.wall_now = wall_now
        self.context_lengths = context_lengths
        self.gate = build_gate(config, served(), wall_now, context_lengths())
        self.quotas = TenantQuotas(open_quota_store(self.gate.config), self.gate.config)
        """The quota engine; its store (in process, or Redis at [gateway] redis_url) is chosen at start:
        a reload changes tenants' limits, not where quota state lives."""
        self._log("gateway:", self.gate)

    def current(self) -> Gate:
        return self.gate

    def reload(self) -> dict[str, Any]:
        """Re-read and validate the whole config file, then swap the gate in one assignment; raises
        ConfigError (and keeps the running gate) when the file is not valid."""
        if self.config_path is None:
            raise ConfigError("the server was started without --config: there is no file to reload")
        config = load_server_config(self.config_path, {})
        changes = self.models.plan(config.model_overrides) if self.models is not None else None
        gate = build_gate(config, self.served(), self.wall_now, self.context_lengths())
        # everything validated: swap (nothing below raises)
        summary = {**gate.summary(), "changed": {"tenants": tenant_changes(self.gate, gate)}}
        if self.models is not None and changes is not None:
            summary["changed"] |= self.models.apply(changes)
        self.gate = gate
        self._log(f"reloaded {self.config_path}:", gate)
        log.info("reload: changed %s", summary["changed"])
        return summary

    def reload_or_log(self) -> None:
        """SIGHUP: reload, or log why the file was refused."""
        try:
            self.reload()
        except ConfigError as exc:
            log.error("SIGHUP: config not reloaded, the running tenants, keys and models stay: %s", exc)

    @staticmethod
    def _log(what: str, gate: Gate) -> None:
        if gate.enforced:
            names = sorted(gate.directory.tenants)
            log.info(
                "%s %d tenants %s, %d keys: API keys required", what, len(names), names, len(gate.directory)
            )
        else:
            log.info("%s none configured: no API key required", what)
