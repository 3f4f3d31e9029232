"""The per-model `traffic` setting: how requests that name no version are split between served
versions, what is mirrored, and where a request goes when its model cannot take it.

    [models.sim.traffic]            # or `traffic = { ... }` in model.toml
    canary = { version = 2, weight = 0.1, steps = [0.1, 0.5, 1.0], step_interval_s = 300 }
    rollback = { max_error_ratio = 0.05, max_p99_ms = 500 }
    ab = { arms = { "1" = 0.5, "2" = 0.5 }, sticky_by = "tenant" }     # exclusive with canary
    shadow = { version = 2, fraction = 0.2 }
    fallback = "other-model"

Kept apart from the traffic code (it imports only pydantic) so config.py can import it without a cycle.
Cross-checks that need the served versions (a canary version that is not served, an unknown fallback
model) are made where the versions are known, at start and on reload.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Canary(_Frozen):
    version: int = Field(ge=1)
    """The version under test; the rest of the unversioned traffic goes to the default version."""
    weight: float = Field(default=0.1, ge=0.0, le=1.0)
    """Its share of requests that name no version (the first step's, when `steps` is set)."""
    steps: tuple[float, ...] = ()
    """Progressive delivery: the weights it moves through, one every step_interval_s, while healthy; a
    last step of 1.0 makes it the default version."""
    step_interval_s: float = Field(default=300.0, gt=0.0)

    @field_validator("steps")
    @classmethod
    def _rising(cls, steps: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0.0 < s <= 1.0 for s in steps) or list(steps) != sorted(steps):
            raise ValueError(f"canary steps {list(steps)} must rise, each in (0, 1]")
        return steps


class Rollback(_Frozen):
    """The canary goes to weight 0 by itself when, over both windows, it burns its budget faster than
    the baseline does (or breaks an absolute bound)."""

    max_error_ratio: float | None = Field(default=None, gt=0.0, le=1.0)
    """Errors (5xx, timeouts) per request above which the canary is rolled back."""
    max_p99_ms: float | None = Field(default=None, gt=0.0)
    """p99 latency above which the canary is rolled back."""
    short_window_s: float = Field(default=60.0, gt=0.0)
    long_window_s: float = Field(default=300.0, gt=0.0)
    min_requests: int = Field(default=20, ge=1)
    """No verdict on fewer canary requests than this in a window."""


class AB(_Frozen):
    arms: dict[int, float]
    """Version -> share of requests that name no version; the shares sum to 1."""
    sticky_by: str = "tenant"
    """"tenant", or "header:NAME": the same value always gets the same arm, on every front end."""

    @field_validator("arms")
    @classmethod
    def _sum_to_one(cls, arms: dict[int, float]) -> dict[int, float]:
        if not arms or any(w < 0 for w in arms.values()) or abs(sum(arms.values()) - 1.0) > 1e-6:
            raise ValueError(f"ab arms {arms} must be non-negative shares that sum to 1")
        return arms

    @field_validator("sticky_by")
    @classmethod
    def _sticky(cls, value: str) -> str:
        if value != "tenant" and not (value.startswith("header:") and len(value) > len("header:")):
            raise ValueError(f'ab sticky_by {value!r} must be "tenant" or "header:NAME"')
        return value


class Shadow(_Frozen):
    version: int = Field(ge=1)
    """The version that also runs a copy of each sampled request; its answers never reach callers."""
    fraction: float = Field(default=0.1, gt=0.0, le=1.0)


class TrafficConfig(_Frozen):
    canary: Canary | None = None
    rollback: Rollback | None = None
    ab: AB | None = None
    shadow: Shadow | None = None
    fallback: str | None = None
    """Another model that answers when this one is overloaded (a queue 429), has no ready worker (503)
    or cannot meet the deadline; never for a tenant's own quota 429."""

    @model_validator(mode="after")
    def _exclusive(self) -> TrafficConfig:
        if self.canary is not None and self.ab is not None:
            raise ValueError("a model takes either a canary or an A/B split, not both: remove one")
        if self.rollback is not None and self.canary is None:
            raise ValueError("rollback applies to a canary: add `canary = { version = N, weight = W }`")
        return self
