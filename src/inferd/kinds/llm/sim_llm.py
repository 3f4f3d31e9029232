"""`sim-llm`: the simulated LLM, driven by the continuous-batching engine in its worker.

Cost model, per engine step (one step = one forward pass over every scheduled chunk):

    step_s = step_base_ms + per_token_ms * tokens_in_step + per_context_token_ms * context_tokens

`tokens_in_step` counts prefill chunk tokens and one token per decoding sequence; `context_tokens` sums
the context each chunk attends over. All three are `params` (defaults 5 ms, 0.05 ms, 0.0005 ms).
A slow first call (lazy initialization, kernel autotuning): `params.warmup_ms` adds that much to the first
step after load, which is the worker's warm-up (kinds/llm/warmup.py), run before it takes traffic.

Tokens are words. The tokenizer splits on whitespace; a prompt word's id is a stable hash of the word.
Output token i of a request is a documented deterministic function of the request, so any client can
check its own stream:

    digest = sha256(f"{seed}:" + ",".join(prompt token ids))
    token_i = VOCAB[int.from_bytes(sha256(digest + i.to_bytes(4, "big"))[:4], "big") % len(VOCAB)]

A completion's text is the words joined by single spaces. `sim_llm_tokens(prompt, seed, n)` gives the
first n words; a chat request's prompt is `sim_llm_chat_prompt(messages)`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from inferd.config import ModelConfig
from inferd.kinds.llm.model import LLMModel, LLMRequest
from inferd.kinds.llm.plan import SeqOutput, StepPlan

VOCAB = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more can about said them what some out like time into only other new could people two up"
).split()
"""The 64 words sim-llm generates; output token id k is VOCAB[k]."""

_PROMPT_ID_BASE = 1 << 20


class SimTokenizer:
    """Whitespace tokenizer. Prompt words hash to ids >= 2**20; generated ids index VOCAB."""

    def encode(self, text: str, special: bool = False) -> list[int]:
        return [_word_id(w) for w in text.split()]

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return sim_llm_chat_prompt(messages)

    def detokenizer(self) -> SimDetokenizer:
        return SimDetokenizer()


class SimDetokenizer:
    """Output words joined by single spaces, with no leading space."""

    def __init__(self) -> None:
        self.first = True

    def feed(self, token_ids: Sequence[int]) -> str:
        words = " ".join(VOCAB[t] for t in token_ids)
        if not words or self.first:
            self.first = self.first and not words
            return words
        return " " + words

    def flush(self) -> str:
        return ""


def _word_id(word: str) -> int:
    return _PROMPT_ID_BASE + int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") % (1 << 30)


def _prompt_digest(seed: int, prompt_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(f"{seed}:".encode() + ",".join(map(str, prompt_ids)).encode()).digest()


def _token_at(digest: bytes, i: int) -> int:
    return int.from_bytes(hashlib.sha256(digest + i.to_bytes(4, "big")).digest()[:4], "big") % len(VOCAB)


def sim_llm_tokens(prompt: str, seed: int | None, n: int) -> list[str]:
    """The first n words sim-llm generates for `prompt` with `seed` (None means 0)."""
    digest = _prompt_digest(seed or 0, SimTokenizer().encode(prompt))
    return [VOCAB[_token_at(digest, i)] for i in range(n)]


def sim_llm_chat_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """The prompt a chat request becomes: one 'role: content' line per message, then 'assistant:'."""
    lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
    return "\n".join([*lines, "assistant:"])


def sim_llm_config(name: str = "sim-llm", **overrides: Any) -> ModelConfig:
    params = {
        "step_base_ms": 5.0,
        "per_token_ms": 0.05,  # nosec B105  # a time per token, not a password
        "per_context_token_ms": 0.0005,  # nosec B105  # a time per token, not a password
        "max_model_len": 2048,
        **overrides.pop("params", {}),
    }
    return ModelConfig(
        name=name,
        implementation="inferd.kinds.llm.sim_llm:SimLLM",
        platform="inferd_llm",
        kind="llm",
        params=params,
        **overrides,
    )


class SimLLM(LLMModel):
    """Sleeps the cost model's step time; samples the documented deterministic tokens."""

    @classmethod
    def front_end_tokenizer(cls, config: ModelConfig) -> SimTokenizer:
        return SimTokenizer()

    def load(self) -> None:
        p = self.config.params
        self.base_s = float(p.get("step_base_ms", 5.0)) / 1000.0
        self.per_token_s = float(p.get("per_token_ms", 0.05)) / 1000.0
        self.per_context_s = float(p.get("per_context_token_ms", 0.0005)) / 1000.0
        self.first_call_s = float(p.get("warmup_ms", 0.0)) / 1000.0
        self._digests: dict[str, bytes] = {}

    def step_cost_s(self, plan: StepPlan) -> float:
        context = sum(c.start + len(c.token_ids) for c in plan.chunks)
        return self.base_s + self.per_token_s * plan.num_tokens + self.per_context_s * context

    def run_step(self, plan: StepPlan, requests: Mapping[str, LLMRequest]) -> dict[str, SeqOutput]:
        start = time.perf_counter()
        extra_s, self.first_call_s = self.first_call_s, 0.0  # the first call's cost (warmup_ms), once
        outputs = {}
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            req = requests[chunk.seq_id]
            digest = self._digests.get(chunk.seq_id)
            if digest is None:
                digest = self._digests[chunk.seq_id] = _prompt_digest(req.seed or 0, req.prompt)
            i = chunk.start + len(chunk.token_ids) - len(req.prompt)
            outputs[chunk.seq_id] = SeqOutput(token=_token_at(digest, i))
        remaining = extra_s + self.step_cost_s(plan) - (time.perf_counter() - start)
        if remaining > 0:
            time.sleep(remaining)
        return outputs

    def release(self, seq_id: str) -> None:
        self._digests.pop(seq_id, None)
