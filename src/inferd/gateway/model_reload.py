"""What a reload of the `--config` file changes in the served models: their `[models.NAME.traffic]`
and `[models.NAME.cache]` tables, live. Every other `[models.NAME]` key (batching, workers, params...)
is read once by the runtimes it built: a change of one is reported as needing a restart, never applied.

`ModelSettings.plan` validates a file's `[models.*]` tables against the served models (each table as a
whole model config, the traffic tables' versions against the served versions, the fallbacks against the
served models) and returns `ModelChanges` without touching anything; `ModelSettings.apply` then swaps
them in: the runtimes' configs (shadow and fallback read them per request), the traffic splits
(`Traffic.reload`) and the response cache's stores (`CacheStores.reconfigure`). The gateway plans
first and applies only once the whole file has passed, so a refused file changes nothing.

A table that leaves the file puts back the model's own setting (its model.toml, read again from the
repository; a built-in model's default without one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from inferd.config import ConfigError, ModelConfig, ServerConfig, describe_validation_error
from inferd.config.cache import CacheConfig
from inferd.gateway.fallback import check_fallbacks
from inferd.gateway.traffic_control import Traffic, check_traffic
from inferd.runtime.kinds import KindRegistry
from inferd.runtime.registry import ModelRegistry

log = logging.getLogger("inferd.gateway")

LIVE = ("traffic", "cache")
"""The [models.NAME] keys a reload applies without a restart."""

Overrides = Mapping[str, Mapping[str, Any]]
OwnSettings = Callable[[str, int], ModelConfig]
"""A served version's own config (model.toml, without the --config file's overrides)."""


class CacheStores(Protocol):
    """The response cache's stores (api/cache_hook.py's `CacheHook`)."""

    def reconfigure(self, model: str, version: int, config: CacheConfig) -> int:
        """Take a version's new cache setting; returns how many stored answers were dropped."""
        ...


@dataclass(frozen=True, slots=True)
class ModelChanges:
    """A validated file's effect on the served models, not yet applied."""

    overrides: dict[str, dict[str, Any]]
    """The [models.*] tables the running configs are built from once applied."""
    configs: dict[tuple[str, int], ModelConfig] = field(default_factory=dict)
    """(model, version) -> its new config, for the versions whose traffic or cache table changed."""
    traffic: tuple[str, ...] = ()
    """Models whose traffic table changed."""
    needs_restart: tuple[str, ...] = ()
    """`models.NAME.KEY` settings the file changed that only a restart applies."""


def own_settings(config: ServerConfig) -> OwnSettings:
    """Read a served version's own config again: from the model repository, else the built-in's."""
    from inferd.kinds.repository import builtin_config, load_model_version

    def own(name: str, version: int) -> ModelConfig:
        if config.model_repo is not None:
            return load_model_version(config.model_repo / name, version)
        return builtin_config(name)

    return own


class ModelSettings:
    def __init__(
        self,
        registry: ModelRegistry,
        traffic: Traffic,
        cache: CacheStores,
        overrides: Overrides,
        own: OwnSettings,
        kinds: KindRegistry,
    ) -> None:
        self.registry = registry
        self.traffic = traffic
        self.cache = cache
        self.overrides: dict[str, dict[str, Any]] = {k: dict(v) for k, v in overrides.items()}
        """The [models.*] tables the running configs were built from."""
        self.own = own
        self.kinds = kinds

    def plan(self, overrides: Overrides) -> ModelChanges:
        """The changes a file's [models.*] tables make; ConfigError (naming the fix) when they do not
        validate against the served models. Changes nothing."""
        served = self.registry.names()
        unknown = sorted(set(overrides) - set(served))
        if unknown:
            raise ConfigError(
                f"config file sets [models.X] for unknown models {unknown}; served: {served}: "
                "remove those tables (a reload cannot add a model)"
            )
        new = {name: dict(table) for name, table in overrides.items()}
        candidates = {
            (rt.name, rt.version): self._candidate(rt.config, new.get(rt.name, {})) for rt in self.registry
        }
        check_traffic(candidates.values())
        defaults = [candidates[(name, self.registry.default_version(name))] for name in served]
        check_fallbacks(
            defaults, lambda name: {c.kind for c in candidates.values() if c.name == name}, self.kinds
        )
        running = {(rt.name, rt.version): rt.config for rt in self.registry}
        changed = {k: c for k, c in candidates.items() if c is not running[k]}
        return ModelChanges(
            overrides=self._applied(new),
            configs=changed,
            traffic=tuple(
                sorted({n for (n, v), c in changed.items() if c.traffic != running[(n, v)].traffic})
            ),
            needs_restart=self._needs_restart(new),
        )

    def apply(self, changes: ModelChanges) -> dict[str, Any]:
        """Swap a planned change in (never raises); returns what changed, for the reload's answer."""
        cache: dict[str, str] = {}
        for (name, version), config in changes.configs.items():
            rt = self.registry.get(name, version)
            before = rt.config.cache
            rt.config = config
            if config.cache is not before:
                dropped = self.cache.reconfigure(name, version, config.cache)
                cache[f"{name}:{version}"] = _cache_change(config.cache, dropped)
        traffic = {name: self.traffic.reload(name) for name in changes.traffic}
        self.overrides = changes.overrides
        for key in changes.needs_restart:
            log.warning("reload: %s changed in the config file; it takes effect at the next restart", key)
        return {"traffic": traffic, "cache": cache, "needs_restart": list(changes.needs_restart)}

    def _candidate(self, running: ModelConfig, table: dict[str, Any]) -> ModelConfig:
        """`running` with the file's traffic and cache tables (validated with the whole table); the
        very same object when neither changed."""
        old = self.overrides.get(running.name, {})
        live: dict[str, Any] = {k: table[k] for k in LIVE if k in table}
        for key in (k for k in LIVE if k not in table and k in old):  # the table left the file
            live[key] = getattr(self._own(running), key)
        data = running.model_dump()
        params = {**data.get("params", {}), **table.get("params", {})}
        try:
            full = ModelConfig(**{**data, **table, **live, "params": params})
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(f"[models.{running.name}] table", exc)) from None
        self.kinds.check_slo(full)  # refused as ModelConfig's own validators refuse
        update = {k: getattr(full, k) for k in LIVE if getattr(full, k) != getattr(running, k)}
        return running.model_copy(update=update) if update else running

    def _own(self, running: ModelConfig) -> ModelConfig:
        try:
            return self.own(running.name, running.version)
        except ConfigError as exc:
            raise ConfigError(
                f"[models.{running.name}]: its model's own settings cannot be read again ({exc}); keep the "
                "table in the file or fix the model's folder"
            ) from None

    def _applied(self, new: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The tables the running configs will have been built from: the file's live keys, the running
        values of the rest (so a change waiting for a restart is reported again on the next reload)."""
        applied: dict[str, dict[str, Any]] = {}
        for name in set(new) | set(self.overrides):
            old = {k: v for k, v in self.overrides.get(name, {}).items() if k not in LIVE}
            table = {**old, **{k: v for k, v in new.get(name, {}).items() if k in LIVE}}
            if table:
                applied[name] = table
        return applied

    def _needs_restart(self, new: dict[str, dict[str, Any]]) -> tuple[str, ...]:
        missing = object()
        found = []
        for name in sorted(set(new) | set(self.overrides)):
            table, old = new.get(name, {}), self.overrides.get(name, {})
            for key in sorted((set(table) | set(old)) - set(LIVE)):
                if table.get(key, missing) != old.get(key, missing):
                    found.append(f"models.{name}.{key}")
        return tuple(found)


def _cache_change(config: CacheConfig, dropped: int) -> str:
    if not config.enabled:
        return f"off ({dropped} answers dropped)"
    settings = f"on, ttl_s {config.ttl_s:g}, max_entries {config.max_entries}, max_bytes {config.max_bytes}"
    return settings + (f" ({dropped} answers dropped)" if dropped else "")
