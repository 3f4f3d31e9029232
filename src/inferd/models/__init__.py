"""The model API users implement, and the built-in batch models (sim, minilm). The LLM models live with
their kind (kinds/llm/)."""

from inferd.models.base import Model

__all__ = ["Model"]
