"""The autoscaling policy's settings (a model's [autoscale] table), apart from the policy so that the
config loader and the recommendation steps import them without importing the policy."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AutoscalerConfig(BaseModel):
    """Scaling policy for one model's fleet."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_workers: int = Field(default=1, ge=0)
    """Fewest workers, whatever the load (0 allows scale to zero)."""
    max_workers: int = Field(default=8, ge=1)
    """Most workers, whatever the load."""
    target_busy_ratio: float = Field(default=0.7, gt=0.0, le=1.0)
    """Fraction of full-batch capacity the fleet should run at; the rest is headroom for bursts."""
    max_predicted_wait_s: float = Field(default=0.5, gt=0.0)
    """Predicted queue wait (depth / fleet capacity) above which the fleet grows to drain the backlog."""
    scale_down_margin: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Hysteresis: scale down only if one worker fewer would run below target_busy_ratio x (1 - margin).
    0.2 keeps ±10% noise in the measured rate from flapping the fleet (1.1 / 0.9 < 1 / 0.8)."""
    scale_up_cooldown_s: float = Field(default=15.0, ge=0.0)
    """After any change, wait this long before scaling up."""
    scale_down_cooldown_s: float = Field(default=120.0, ge=0.0)
    """After any change, wait this long before scaling down (longer than the scale-up cooldown)."""
    scale_up_stabilization_s: float = Field(default=0.0, ge=0.0)
    """Scale up to the lowest recommendation seen over this window (0: react to the latest)."""
    scale_down_stabilization_s: float = Field(default=60.0, ge=0.0)
    """Scale down to the highest recommendation seen over this window."""
    max_step_up_workers: int = Field(default=1, ge=1)
    """Most workers added by one decision (a scale-down always removes one)."""
    target_kv_usage: float = Field(default=0.8, gt=0.0, le=1.0)
    """LLM models: share of the engines' KV blocks the fleet should run at."""
    target_ttft_s: float = Field(default=2.0, gt=0.0)
    """LLM models: recent time to first token above which the fleet grows."""
    max_waiting_per_worker: float = Field(default=4.0, gt=0.0)
    """LLM models: sequences waiting for admission per ready worker above which the fleet grows."""

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalerConfig:
        if self.max_workers < self.min_workers:
            raise ValueError(
                f"max_workers ({self.max_workers}) is below min_workers ({self.min_workers}): "
                "raise max_workers or lower min_workers"
            )
        if self.scale_down_cooldown_s < self.scale_up_cooldown_s:
            raise ValueError(
                f"scale_down_cooldown_s ({self.scale_down_cooldown_s}) is shorter than scale_up_cooldown_s "
                f"({self.scale_up_cooldown_s}): scale-down must be the slower direction; raise it"
            )
        return self
