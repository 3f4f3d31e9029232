"""The front end's tokenizer of a GGUF model: the vocabulary and the chat template stored in the file.

The front end loads the model vocabulary-only (no weights, ~0.1 s), so tokenizing, the context-length
check and detokenizing happen before and after the worker, never inside the engine's step.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence
from typing import Any

from inferd.config import ConfigError, ModelConfig
from inferd.models.llama_cpp import gguf_path


class GGUFTokenizer:
    def __init__(self, llama: Any, template: str | None) -> None:
        self.llama = llama
        self._formatter = None
        if template:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            eos = llama.detokenize([llama.token_eos()], special=True).decode("utf-8", "replace")
            bos = llama.detokenize([llama.token_bos()], special=True).decode("utf-8", "replace")
            self._formatter = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos)

    @classmethod
    def from_config(cls, config: ModelConfig) -> GGUFTokenizer:
        try:
            import llama_cpp
        except ImportError as exc:
            raise ConfigError(
                f"model {config.name!r} needs llama-cpp-python: run scripts/setup (the `llama` extra)"
            ) from exc
        llama = llama_cpp.Llama(model_path=str(gguf_path(config.params)), vocab_only=True, verbose=False)
        return cls(llama, llama.metadata.get("tokenizer.chat_template"))

    def encode(self, text: str, special: bool = False) -> list[int]:
        return self.llama.tokenize(text.encode(), add_bos=True, special=special)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self._formatter is None:
            raise ConfigError("this model's GGUF file has no chat template: use /v1/completions")
        return self._formatter(messages=[dict(m) for m in messages]).prompt

    def detokenizer(self) -> GGUFDetokenizer:
        return GGUFDetokenizer(self.llama)


class GGUFDetokenizer:
    """Token bytes through an incremental UTF-8 decoder: a character split over tokens shows up once
    its last byte has arrived; control tokens (end of turn) have no text."""

    def __init__(self, llama: Any) -> None:
        self.llama = llama
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_ids: Sequence[int]) -> str:
        """Byte-level BPE pieces concatenate exactly, so each delta is decoded on its own."""
        return self.utf8.decode(self.llama.detokenize(list(token_ids), special=False))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
