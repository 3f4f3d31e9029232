"""The front end's tokenizer of a GGUF model: the vocabulary and the chat template stored in the file.

The front end loads the model vocabulary-only (no weights, ~0.1 s), so tokenizing, the context-length
check and detokenizing happen before and after the worker, never inside the engine's step.
"""

from __future__ import annotations

import codecs
import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

from inferd.config import ConfigError, ModelConfig
from inferd.errors import BadRequest
from inferd.kinds.llm.gguf import gguf_path, route_llama_log


class GGUFTokenizer:
    def __init__(self, llama: Any, template: str | None, model: str = "") -> None:
        import llama_cpp

        self.llama = llama
        self.model = model
        self._vocab = llama_cpp.llama_model_get_vocab(llama.model)
        self._pieces: dict[int, bytes] = {}
        self._formatter = None
        if template:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            eos, bos = llama.token_eos(), llama.token_bos()
            self._formatter = Jinja2ChatFormatter(
                template,
                eos_token=self.piece(eos, special=True).decode("utf-8", "replace") if eos >= 0 else "",
                bos_token=self.piece(bos, special=True).decode("utf-8", "replace") if bos >= 0 else "",
            )

    def piece(self, token: int, special: bool = False) -> bytes:
        """A token's bytes, whatever their length (llama-cpp-python's own detokenize cuts pieces over 32
        bytes, such as long runs of spaces, to nothing). Cached: the vocabulary is fixed."""
        key = token if not special else -1 - token
        cached = self._pieces.get(key)
        if cached is None:
            import llama_cpp

            size = 64
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, size, 0, special)
            if n < 0:
                size = -n
                buf = ctypes.create_string_buffer(size)
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, size, 0, special)
            cached = self._pieces[key] = buf.raw[: max(0, n)]
        return cached

    @classmethod
    def from_config(cls, config: ModelConfig) -> GGUFTokenizer:
        try:
            import llama_cpp
        except ImportError as exc:
            raise ConfigError(
                f"model {config.name!r} needs llama-cpp-python: run scripts/setup (the `llama` extra)"
            ) from exc
        route_llama_log()
        llama = llama_cpp.Llama(model_path=str(gguf_path(config.params)), vocab_only=True, verbose=False)
        return cls(llama, llama.metadata.get("tokenizer.chat_template"), config.name)

    def encode(self, text: str, special: bool = False) -> list[int]:
        """A rendered chat template (`special`) carries its own BOS where the model wants one, so none is
        added then (as llama-cpp-python's own chat handler does); a raw prompt gets the model's BOS."""
        return self.llama.tokenize(text.encode(), add_bos=not special, special=special)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self._formatter is None:
            raise BadRequest(
                f"model {self.model!r} has no chat template (its GGUF file holds no "
                "tokenizer.chat_template), so it cannot format chat messages: send a plain prompt to "
                "/v1/completions instead"
            )
        return self._formatter(messages=[dict(m) for m in messages]).prompt

    def detokenizer(self) -> GGUFDetokenizer:
        return GGUFDetokenizer(self)


class GGUFDetokenizer:
    """Token bytes through an incremental UTF-8 decoder: a character split over tokens shows up once
    its last byte has arrived; control tokens (end of turn) have no text."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_ids: Sequence[int]) -> str:
        """Byte-level BPE pieces concatenate exactly, so each token is decoded on its own."""
        return self.utf8.decode(b"".join(self.tokenizer.piece(t) for t in token_ids))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
