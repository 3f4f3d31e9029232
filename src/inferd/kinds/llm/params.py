"""The typed params every LLM model shares (the `llm` kind's params model, checked at start): context
length, the engine's budgets, routing across workers and the hang timeout. Backend-specific keys (a GGUF
path, sim-llm's step costs, llama.cpp threads) are the backend's own and pass through."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inferd.config import ConfigError, ModelConfig, describe_validation_error
from inferd.kinds.llm.plan import SchedulerConfig
from inferd.kinds.llm.routing import RoutingConfig


class LLMParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")

    max_model_len: int = Field(default=2048, ge=16, le=1_048_576)
    """Prompt plus completion tokens of one sequence."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """The engine's budgets: seats, tokens per step, KV blocks, waiting bounds."""
    routing: RoutingConfig = RoutingConfig()
    """How sequences spread over the model's workers."""
    hang_timeout_s: float | None = Field(default=None, gt=0.0, le=3600.0)
    """No engine step for this long while sequences run: the worker is killed (None: from step times)."""


def llm_params(config: ModelConfig) -> LLMParams:
    """The model's params as LLMParams (checked at start too: here the error names the model)."""
    try:
        return LLMParams.model_validate(config.params)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(f"params of llm model {config.name!r}", exc)) from None
