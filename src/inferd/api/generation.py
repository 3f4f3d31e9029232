"""A text generation under its Call, whatever the edge (the OpenAI routes in api/completions.py, the
gRPC edge's vLLM tensors in grpc_edge/): the call's deadline, priority, tenant and token quota handed
to the model's LlmService (kinds/llm/service.py).

Deadlines: text generation has none by default (a model's default_timeout_ms would cut long answers
short); the caller's (`call.timeout_ms`, in (0, max_timeout_ms]) applies.
Cache: a whole answer whose text is deterministic (temperature 0, or a seed) may come from the model's
response cache (`cache_key`).
Quotas: a limited tenant's call reserves its tokens (prompt + n x max_tokens) before anything is
submitted, and is refunded what its choices did not use (gateway/quota_layer.py `reserve_tokens`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from inferd.api.http import request_deadline
from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.core.call import Call
from inferd.gateway.auth import tenant_share
from inferd.gateway.quota_layer import reserve_tokens
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.service import Choices, Completion, GenerationRequest, Reserve


def text_deadline(clock: Clock, config: ModelConfig, call: Call, timeout_us: float | None = None) -> float | None:
    """The caller's deadline: the smallest of `call.timeout_ms` (X-Request-Timeout-Ms), `timeout_us` (a
    request's own, OIP's parameters.timeout) and `call.deadline` (the one its wire carries, gRPC's);
    text generation gets no default deadline, so a long answer is never cut short unless the caller
    asks."""
    return request_deadline(clock, config.max_timeout_ms, timeout_us, call.timeout_ms, None, call.deadline)


async def generate(rt: LLMRuntime, request: GenerationRequest, call: Call) -> Choices:
    """Every choice submitted (rt.service: tokenize, check the context, the deadline and the quota),
    under the call's deadline, priority and tenant (one value: the prefix-cache salt and the lane)."""
    return await rt.service.generate(
        request,
        deadline=call.deadline,
        priority=call.priority,
        share=tenant_share(call.tenant),
        reserve=token_reserve(call),
    )


async def collect(rt: LLMRuntime, request: GenerationRequest, call: Call) -> Completion:
    """`generate`, then every choice's whole text; the wait ends (ClientGone) if the caller leaves."""
    return await rt.service.collect(
        request,
        deadline=call.deadline,
        priority=call.priority,
        share=tenant_share(call.tenant),
        reserve=token_reserve(call),
        gone=call.departure.watch,
    )


def cache_key(request: GenerationRequest) -> tuple[Any, ...] | None:
    """What decides a whole answer's text, for the response cache (never the deadline or priority);
    None when the text is not deterministic (a temperature above 0 without a seed): not cached."""
    if not (request.temperature == 0 or (request.seed is not None and request.seed >= 0)):
        return None
    g = request.checked()
    return (request.prompt, request.max_tokens, g.seed, g.temperature, g.top_p, g.ignore_eos, request.n, request.stops)


def token_reserve(call: Call) -> Reserve | None:
    """The quota's token admission of a limited tenant's call (None: nothing to reserve)."""
    return None if call.quota is None else partial(reserve_tokens, call)
