"""The prompt of a text-generation request: a completion's prompt text, a chat's rendered template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from inferd.errors import BadRequest, ServingError
from inferd.kinds.llm.model import Tokenizer


class Message(Protocol):
    role: str
    content: str | None


def chat_prompt(tokenizer: Tokenizer, model: str, messages: Sequence[Message]) -> str:
    """The messages through the model's chat template (a null content is empty text). A template that
    refuses them (an unknown role, roles out of the order it wants) is a 400 naming the reason."""
    try:
        return tokenizer.chat_prompt([{"role": m.role, "content": m.content or ""} for m in messages])
    except ServingError:
        raise
    except Exception as exc:  # the template's own checks (raise_exception) or its failure on these messages
        raise BadRequest(
            f"model {model!r} cannot format these messages with its chat template: {exc}"
        ) from None


def prompt_text(prompt: str | list[Any]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise BadRequest("prompt must be one string (lists of prompts and token ids are not supported yet)")
