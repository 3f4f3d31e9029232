"""The model API of LLM backends: the engine loop in the worker hands each step's plan to `run_step`.

An LLM model is an `inferd.Model` whose config has `platform = "inferd_llm"`. Its worker runs the
continuous-batching engine (inferd.kinds.llm.engine) instead of the batch loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from inferd.config import ConfigError, ModelConfig
from inferd.kinds.llm.plan import SeqOutput, StepPlan
from inferd.models.base import Model
from inferd.models.loader import load_model_class

LLM_PLATFORM = "inferd_llm"


def is_llm(config: ModelConfig) -> bool:
    """Whether the model is served by the LLM engine (token streams) rather than the batcher."""
    return config.kind == "llm"


@dataclass(frozen=True, slots=True)
class LLMRequest:
    """What the model needs to know about one live sequence besides the plan."""

    seq_id: str
    prompt: tuple[int, ...]
    seed: int | None = None
    """None: unseeded (a real model samples from fresh entropy; sim-llm uses 0)."""
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False


class Detokenizer(Protocol):
    """Text of one stream's tokens, piece by piece: it holds back bytes of a character that a later
    token completes, and never shows control tokens (end of turn)."""

    def feed(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of `text`; `special`: parse control-token markup (chat templates) as control tokens."""
        ...

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The model's chat template applied to OpenAI-style messages, ending where the assistant speaks."""
        ...

    def detokenizer(self) -> Detokenizer: ...


class LLMModel(Model):
    """Base class of LLM backends. `run_step` runs in the worker's device thread; `front_end_tokenizer`
    runs in the front end (which imports the class, never instantiates it)."""

    @classmethod
    def front_end_tokenizer(cls, config: ModelConfig) -> Tokenizer:
        """The tokenizer the front end encodes prompts and decodes tokens with for this model."""
        raise ConfigError(
            f"model {config.name!r}: {cls.__name__} has no front-end tokenizer: define the classmethod "
            "front_end_tokenizer(config) returning an inferd.kinds.llm.model.Tokenizer"
        )

    def run_step(self, plan: StepPlan, requests: Mapping[str, LLMRequest]) -> dict[str, SeqOutput]:
        """Compute every chunk of `plan`; return a SeqOutput (the sampled token) per sampling chunk."""
        raise NotImplementedError(f"{type(self).__name__} must implement run_step")

    def release(self, seq_id: str) -> None:
        """The sequence ended: drop any per-sequence state."""

    def predict_batch(self, inputs: list) -> list:
        raise NotImplementedError(f"{type(self).__name__} is an LLM: it runs steps, not batches")


def tokenizer_for(config: ModelConfig) -> Tokenizer:
    """The front end's tokenizer of an LLM model, from the model class its config names (the backend
    knows its tokenizer: sim-llm's whitespace words, a GGUF file's vocabulary)."""
    try:
        cls = load_model_class(config.implementation)
    except ValueError as exc:
        raise ConfigError(f"model {config.name!r}: {exc}") from None
    if not issubclass(cls, LLMModel):
        raise ConfigError(
            f"model {config.name!r} has platform {LLM_PLATFORM!r} but {config.implementation} is not an "
            "inferd.kinds.llm.model.LLMModel"
        )
    return cls.front_end_tokenizer(config)
