"""An LLM model's request over gRPC, under its Call: the vLLM tensors read (grpc_edge/llm.py), the
generation run through the model's LlmService as the REST text routes run it (api/generation.py: the
caller's deadline, priority, tenant and token quota), its text answered.

    resolve  the model as the REST text routes resolve it (canary and A/B splits, a pinned version,
             its fallback when it has no room)
    read     the tensors; the deadline (the smallest of the gRPC deadline, x-request-timeout-ms and
             parameters.timeout; none by default, as on REST) and parameters.priority
    whole    ModelInfer, or a ModelStreamInfer request with stream false: one response with every
             choice's whole text (from the model's response cache when it is on and the text is
             deterministic); the wait ends (ClientGone) if the caller leaves
    pieces   a ModelStreamInfer request with stream true: every choice submitted (a refusal is raised
             then, before any response), then a streamed reply of one response per text piece; its end
             (the pieces read, the stream cancelled) aborts every sequence still running

Models served upstream (the upstream kind) are reachable over REST only: their requests are refused
here naming the route.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from functools import partial

from inferd.api import generation
from inferd.api.cache_hook import CacheHook
from inferd.api.context import ApiContext
from inferd.api.http import parse_priority
from inferd.core.call import Call
from inferd.errors import BadRequest
from inferd.grpc_edge import llm
from inferd.grpc_edge.codec import request_parameters
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.reply import GrpcReply
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.service import Choices
from inferd.runtime.contract import Runtime

Metadata = Callable[[bytes], "str | None"]
"""The call's metadata by lower-case name (an A/B split may read it)."""


async def text_reply(
    api: ApiContext, call: Call, message: pb.ModelInferRequest, metadata: Metadata, streams: bool
) -> GrpcReply:
    """The reply to an LLM model's request (`streams`: on ModelStreamInfer, where stream=true is
    allowed): the model resolved as the REST text routes resolve it (canary and A/B splits, a pinned
    version), answered by its fallback when it has no room."""
    primary = api.text_model(call, message.model_name, metadata)
    return await api.answer_with_fallback(call, primary, lambda rt: _answer(api, call, message, rt, streams))


async def _answer(
    api: ApiContext, call: Call, message: pb.ModelInferRequest, served: Runtime, streams: bool
) -> GrpcReply:
    rt = llm_runtime(served)
    text = llm.read_text_request(message)
    timeout_us, priority = request_parameters(message)
    call.deadline = generation.text_deadline(api.clock, rt.config, call, timeout_us)
    if priority is not None:  # else x-priority's, or interactive
        call.priority = parse_priority(priority, None)
    if text.stream and not streams:
        raise BadRequest("stream must be false on ModelInfer: send a streamed request on ModelStreamInfer")
    if not text.stream:
        response, worker = await whole(api.cache, call, rt, text, message.id)
        return GrpcReply(response, [(b"x-inferd-worker", worker.encode())])
    choices = await generation.generate(rt, text.generation, call)
    reply = GrpcReply(pieces(choices, rt, text, message.id, llm.empty_final(message)), streamed=True)
    reply.on_close(partial(choices.abort, True))  # a no-op for every sequence that has ended
    return reply


def llm_runtime(rt: Runtime) -> LLMRuntime:
    """The LLM runtime serving a text model's request over gRPC (an upstream model is refused)."""
    if not isinstance(rt, LLMRuntime):
        raise BadRequest(
            f"model {rt.name!r} (kind {rt.kind}) is served by an external engine: call it over REST "
            "(/v1/completions or /v1/chat/completions)"
        )
    return rt


async def whole(
    cache: CacheHook, call: Call, rt: LLMRuntime, text: llm.TextRequest, request_id: str
) -> tuple[pb.ModelInferResponse, str]:
    """One response with every choice's whole text, and the worker that generated it."""

    async def compute() -> tuple[tuple[list[str], str], int]:
        done = await generation.collect(rt, text.generation, call)
        texts = [t for t, _ in done.texts]
        return (texts, done.worker_id), sum(len(t) for t in texts)

    key = generation.cache_key(text.generation) if rt.config.cache.enabled else None
    if key is None:
        (texts, worker), _ = await compute()
    else:
        (texts, worker), _ = await cache.answer(call, rt, ("grpc_text", *key), compute)
    return llm.text_response(request_id, rt.name, str(rt.version), llm.whole_texts(text, texts)), worker


async def pieces(
    choices: Choices, rt: LLMRuntime, text: llm.TextRequest, request_id: str, empty_final: bool
) -> AsyncIterator[llm.Piece]:
    """One response per text piece, the last one flagged; a choice's error (a deadline, a lost worker)
    is raised after the pieces already made. Closing it early aborts every sequence still running; one
    never started has no code of its own to run: its owner aborts the choices (`choices.abort(True)`)."""
    responses = llm.PieceResponses(request_id, rt.name, str(rt.version), text, empty_final)
    async with aclosing(choices.stream()) as texts:
        async for i, piece, finish in texts:
            response = responses.piece(i, piece, finish)
            if response is not None:
                yield response
    last = responses.last()
    if last is not None:
        yield last
