"""A pool's settings: one `[pools.NAME]` table of the server config (`ServerConfig.pools`).

A pool is a set of worker processes that load the models naming it (`pool = "NAME"` in a batch model's
model.toml) on demand, each within its own memory budget (docs/architecture.md, "Pools"). The pool's
workers are told these settings when they join (Welcome.pool_config_json); the front ends place loads
with them (pools/placement.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

PoolName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
"""A pool's name: what `[pools.NAME]` and a model's `pool` say."""


class PoolConfig(BaseModel):
    """One `[pools.NAME]` table."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = Field(default=1, ge=0, le=64)
    """Local pool worker processes the server starts (0: only workers that join with `inferd worker
    --pool NAME --connect ...`)."""
    memory_budget_mb: float = Field(gt=0.0)
    """What the models one pool worker holds may use together, in MiB (device memory where there is a
    device, else resident memory): past it, the worker evicts before it loads."""
    max_loaded_models: int | None = Field(default=None, ge=1)
    """The most models one pool worker holds at once, whatever their sizes (None: the budget alone)."""
    max_concurrent_loads: int = Field(default=1, ge=1, le=64)
    """Loads one pool worker runs at once; more wait their turn."""
    min_resident_s: float = Field(default=5.0, ge=0.0, le=86_400.0)
    """A model loaded this recently is not evicted (a load that needs its room waits instead)."""

    @model_validator(mode="after")
    def _limits(self) -> PoolConfig:
        if self.max_loaded_models is not None and self.max_concurrent_loads > self.max_loaded_models:
            raise ValueError(
                f"max_concurrent_loads ({self.max_concurrent_loads}) is above max_loaded_models "
                f"({self.max_loaded_models}): lower it"
            )
        return self


Pools = dict[PoolName, PoolConfig]
"""Every `[pools.NAME]` table: pool name -> its settings."""


class Pooled(Protocol):
    """What the start-time check reads of a model's settings (a ModelConfig)."""

    @property
    def name(self) -> str: ...

    @property
    def pool(self) -> str | None: ...

    @property
    def memory_mb(self) -> float | None: ...


def pool_refusal(model: Pooled, pools: Mapping[str, PoolConfig]) -> str | None:
    """Why this model cannot be served by the pool it names (an unknown pool; bigger than a worker's whole
    budget), or None. ModelConfig refused the rest (a kind other than batch, workers of its own, no size)."""
    if model.pool is None:
        return None
    pool = pools.get(model.pool)
    if pool is None:
        defined = ", ".join(f"[pools.{name}]" for name in sorted(pools)) or "none"
        return (
            f"model {model.name!r}: pool = {model.pool!r} is not defined (pools defined: {defined}): add a "
            f"[pools.{model.pool}] table to the server config, or name one of those"
        )
    if model.memory_mb is not None and model.memory_mb > pool.memory_budget_mb:
        return (
            f"model {model.name!r}: memory_mb = {model.memory_mb:g} is above the memory_budget_mb = "
            f"{pool.memory_budget_mb:g} of pool {model.pool!r} (per worker): no worker of the pool could "
            "hold it; raise the budget or lower memory_mb"
        )
    return None


def pool_refusals(models: Iterable[Pooled], pools: Mapping[str, PoolConfig]) -> list[str]:
    """Why each pooled model that does not fit the pools is refused at start (`pool_refusal`); []: none.
    The callers raise ConfigError with the first (this module sits below inferd.config's error)."""
    return [r for r in (pool_refusal(m, pools) for m in models) if r is not None]
