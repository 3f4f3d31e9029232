"""The model API of LLM backends: the engine loop in the worker hands each step's plan to `run_step`.

An LLM model is an `inferd.Model` whose config has `platform = "inferd_llm"`. Its worker runs the
continuous-batching engine (inferd.llm.engine) instead of the batch loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from inferd.config import ModelConfig
from inferd.llm.plan import SeqOutput, StepPlan
from inferd.models.base import Model

LLM_PLATFORM = "inferd_llm"


def is_llm(config: ModelConfig) -> bool:
    """Whether the model is served by the LLM engine (token streams) rather than the batcher."""
    return config.platform == LLM_PLATFORM


@dataclass(frozen=True, slots=True)
class LLMRequest:
    """What the model needs to know about one live sequence besides the plan."""

    seq_id: str
    prompt: tuple[int, ...]
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], first: bool) -> str: ...


class LLMModel(Model):
    """Base class of LLM backends. `run_step` runs in the worker's device thread."""

    def run_step(self, plan: StepPlan, requests: Mapping[str, LLMRequest]) -> dict[str, SeqOutput]:
        """Compute every chunk of `plan`; return a SeqOutput (the sampled token) per sampling chunk."""
        raise NotImplementedError(f"{type(self).__name__} must implement run_step")

    def release(self, seq_id: str) -> None:
        """The sequence ended: drop any per-sequence state."""

    def predict_batch(self, inputs: list) -> list:
        raise NotImplementedError(f"{type(self).__name__} is an LLM: it runs steps, not batches")


def tokenizer_for(config: ModelConfig) -> Tokenizer:
    """The front end's tokenizer of an LLM model (sim-llm's whitespace tokenizer for now)."""
    from inferd.models.sim_llm import SimTokenizer

    return SimTokenizer()
