"""An LLM model's request over gRPC, under its Call: the vLLM tensors read (grpc_edge/llm.py), the
generation run through the model's LlmService as the REST text routes run it (api/generation.py: the
caller's deadline, priority, tenant and token quota), its text answered.

    whole    ModelInfer, or a ModelStreamInfer request with stream false: one response with every
             choice's whole text (from the model's response cache when it is on and the text is
             deterministic); the wait ends (ClientGone) if the caller leaves
    pieces   a ModelStreamInfer request with stream true: `start` submits every choice (a refusal is
             raised then, before any response), then one response per text piece; closing the pieces
             (the stream cancelled, or the request's answer dropped) aborts every sequence still running

Models served upstream (the upstream kind) are reachable over REST only: their requests are refused
here naming the route.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from inferd.api import generation
from inferd.api.cache_hook import CacheHook
from inferd.clock import Clock
from inferd.core.call import Call
from inferd.errors import BadRequest
from inferd.grpc_edge import llm
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.service import Choices
from inferd.runtime.contract import Runtime


def llm_runtime(rt: Runtime) -> LLMRuntime:
    """The LLM runtime serving a text model's request over gRPC (an upstream model is refused)."""
    if not isinstance(rt, LLMRuntime):
        raise BadRequest(
            f"model {rt.name!r} is a {rt.kind} model, served by an external engine: call it over REST "
            "(/v1/completions or /v1/chat/completions)"
        )
    return rt


def read(clock: Clock, call: Call, rt: LLMRuntime, request: pb.ModelInferRequest) -> llm.TextRequest:
    """The request's tensors read, and the call's deadline set (the smaller of the caller's and the
    request's own `parameters.timeout`, which the edge put in `call.timeout_ms`)."""
    text = llm.read_text_request(request)
    call.deadline = generation.text_deadline(clock, rt.config, call)
    return text


async def whole(
    cache: CacheHook, call: Call, rt: LLMRuntime, text: llm.TextRequest, request_id: str
) -> pb.ModelInferResponse:
    """One response with every choice's whole text."""

    async def compute() -> tuple[list[str], int]:
        done = await generation.collect(rt, text.generation, call)
        texts = [t for t, _ in done.texts]
        return texts, sum(len(t) for t in texts)

    key = generation.cache_key(text.generation) if rt.config.cache.enabled else None
    if key is None:
        texts, _ = await compute()
    else:
        texts, _ = await cache.answer(call, rt, ("grpc_text", *key), compute)
    return llm.text_response(request_id, rt.name, str(rt.version), llm.whole_texts(text, texts))


async def start(call: Call, rt: LLMRuntime, text: llm.TextRequest) -> Choices:
    """Every choice submitted (a refusal raised, nothing left running)."""
    return await generation.generate(rt, text.generation, call)


async def pieces(
    choices: Choices, rt: LLMRuntime, text: llm.TextRequest, request_id: str
) -> AsyncIterator[llm.Piece]:
    """One response per text piece, the last one flagged; a choice's error (a deadline, a lost worker)
    is raised after the pieces already made. Closing it early aborts every sequence still running; one
    never started has no code of its own to run: its owner aborts the choices (`choices.abort(True)`)."""
    responses = llm.PieceResponses(request_id, rt.name, str(rt.version), text)
    async with aclosing(choices.stream()) as texts:
        async for i, piece, finish in texts:
            response = responses.piece(i, piece, finish)
            if response is not None:
                yield response
    last = responses.last()
    if last is not None:
        yield last
