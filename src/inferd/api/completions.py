"""OpenAI-compatible text generation: POST /v1/completions and POST /v1/chat/completions.

parse (the body into a `GenerationRequest`, the Call's deadline, priority and tenant) -> the model's
`LlmService` (kinds/llm/service.py: check, tokenize, context length, deadline, quota tokens, submit every
choice, text with stop strings applied) -> encode: Server-Sent Events (`data: {json}`, then
`data: [DONE]`) or one JSON body. A client that disconnects aborts its sequences in the engine (the
streamed body is closed, which closes the choices' stream; a whole answer's wait watches
`call.departure`).

Length: `max_tokens` (chat: `max_completion_tokens` too); without one, a completion stops at 16 tokens
and a chat answer may use the rest of the context (max_model_len - prompt tokens), as OpenAI's do.

Deadlines: text generation has none by default (a model's default_timeout_ms would cut long answers
short); a caller's X-Request-Timeout-Ms (in (0, max_timeout_ms], as on the OIP route) applies. Past it,
the sequence is aborted in its engine (its KV blocks freed) and the caller gets a 504 with an OpenAI
error object, or, once streaming, an error event and the end of the stream. Models served upstream
forward the time left.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec

from inferd.api import generation, upstream
from inferd.api.asgi import HttpRequest, HttpResponse, StreamingResponse
from inferd.api.errors import status_of
from inferd.api.http import (
    check_content_type,
    decode_json,
    json_response,
    parse_priority,
    read_body,
)
from inferd.api.middleware import record_stream_error
from inferd.api.openai import openai_error
from inferd.api.prompts import chat_prompt
from inferd.api.prompts import prompt_text as _prompt_text
from inferd.core.call import Call
from inferd.errors import BadRequest, ServingError
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.service import Choices, Completion, GenerationRequest
from inferd.kinds.upstream.runtime import UpstreamRuntime

if TYPE_CHECKING:
    from inferd.api.context import ApiContext

Response = HttpResponse | StreamingResponse
TextRuntime = LLMRuntime | UpstreamRuntime
"""What serves a text route: generated here, or forwarded (an LLM model's fallback is one of these too)."""

class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    priority: str | int | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past end-of-turn until max_tokens (for benchmarks)."""


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class _Named(msgspec.Struct):
    model: str


_named = msgspec.json.Decoder(_Named)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatRequest)
_encoder = msgspec.json.Encoder()


# ---- handlers -------------------------------------------------------------------------------------------
async def completions(api: ApiContext, call: Call, request: HttpRequest) -> HttpResponse | StreamingResponse:
    body = await _read(api, request)
    primary = text_model(api, call, body, request)
    return await api.answer_with_fallback(call, primary, lambda rt: _complete(api, call, body, rt))


async def _complete(api: ApiContext, call: Call, body: bytes, rt: TextRuntime) -> Response:
    call.deadline = generation.text_deadline(api.clock, rt.config, call)
    if isinstance(rt, UpstreamRuntime):  # served by external engines
        return await upstream.forward(api, call, rt, body, "/completions")
    req = decode_json(_completion_decoder, body, "completion request", 'send {"model": ..., "prompt": ...}')
    prompt = _prompt_text(req.prompt)
    text = _TextCall(rt, req, call, "text_completion", f"cmpl-{uuid.uuid4().hex}", prompt, req.max_tokens)
    if not req.stream:
        return await text.answer(api, _text_choice)
    return streamed(text, await text.start(), _completion_chunk)


async def chat_completions(api: ApiContext, call: Call, request: HttpRequest) -> HttpResponse | StreamingResponse:
    body = await _read(api, request)
    primary = text_model(api, call, body, request)
    return await api.answer_with_fallback(call, primary, lambda rt: _chat(api, call, body, rt))


async def _chat(api: ApiContext, call: Call, body: bytes, rt: TextRuntime) -> Response:
    call.deadline = generation.text_deadline(api.clock, rt.config, call)
    if isinstance(rt, UpstreamRuntime):  # served by external engines
        return await upstream.forward(api, call, rt, body, "/chat/completions")
    req = decode_json(
        _chat_decoder, body, "chat completion request", 'send {"model": ..., "messages": [...]}'
    )
    if not req.messages:
        raise BadRequest("messages is empty: send at least one {role, content} message")
    prompt = chat_prompt(rt.tokenizer, rt.name, req.messages)
    max_tokens = req.max_completion_tokens or req.max_tokens
    text = _TextCall(rt, req, call, "chat.completion", f"chatcmpl-{uuid.uuid4().hex}", prompt, max_tokens)
    if not req.stream:
        return await text.answer(api, _chat_choice)
    return streamed(text, await text.start(), _chat_chunk)


def _text_choice(i: int, text: str, finish: str | None) -> dict[str, Any]:
    return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}


def _chat_choice(i: int, text: str, finish: str | None) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {"index": i, "message": message, "finish_reason": finish, "logprobs": None}


def text_model(api: ApiContext, call: Call, body: bytes, request: HttpRequest) -> LLMRuntime | UpstreamRuntime:
    """The model the request names: generated here (LLMRuntime) or forwarded (UpstreamRuntime)."""
    name = decode_json(_named, body, "completion request", 'send {"model": ..., ...}').model
    rt = api.text_model(call, name, request.header)
    if not isinstance(rt, LLMRuntime | UpstreamRuntime):
        raise BadRequest(f"model {name!r} is a {rt.kind} model: it does not generate text")
    return rt


def streamed(text: _TextCall, choices: Choices, make: MakeChunk) -> StreamingResponse:
    """The SSE response. Its end aborts what still runs: a body closed mid-stream does it itself, and one
    never started (the client left before the first byte) has no code of its own to run."""
    response = StreamingResponse(text.events(choices, make), headers=worker_header(choices))
    response.on_close(partial(choices.abort, True))  # a no-op for every sequence that has ended
    return response


def worker_header(choices: Choices) -> list[tuple[bytes, bytes]]:
    """X-Inferd-Worker: the worker that generates the response (its first choice's),
    so callers and tests can see where routing placed a request."""
    return [(b"x-inferd-worker", choices.worker_id.encode())]


async def _read(api: ApiContext, request: HttpRequest) -> bytes:
    check_content_type(request, ("application/json", ""))
    return await read_body(request, api.max_body)


# ---- one call ---------------------------------------------------------------------------------------------
class _TextCall:
    """One generation request: what it asks the model's LlmService for, and how its answer is spelled."""

    def __init__(
        self,
        rt: LLMRuntime,
        req: CompletionRequest | ChatRequest,
        call: Call,
        obj: str,
        cid: str,
        prompt: str,
        max_tokens: int | None,
    ):
        self.rt = rt
        self.req = req
        self.call = call
        self.object = obj
        self.id = cid
        self.created = int(time.time())
        stop = req.stop
        self.stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        self.request = GenerationRequest(
            prompt,
            chat=isinstance(req, ChatRequest),
            n=req.n,
            max_tokens=max_tokens,
            seed=req.seed,
            temperature=req.temperature,
            top_p=req.top_p,
            ignore_eos=req.ignore_eos,
            stops=tuple(self.stops),
        )
        self.sampling = self.request.checked()  # a 400 naming the bad parameter, before anything else
        if req.priority is not None:  # else X-Priority's, or interactive
            call.priority = parse_priority(req.priority, None)

    async def start(self) -> Choices:
        """Every choice submitted, under the call's deadline, priority, tenant and quota."""
        return await generation.generate(self.rt, self.request, self.call)

    async def whole(self) -> Completion:
        """`start`, then every choice's whole text; the wait ends (499) if the caller leaves."""
        return await generation.collect(self.rt, self.request, self.call)

    @property
    def include_usage(self) -> bool:
        return self.req.stream_options is not None and self.req.stream_options.include_usage

    def body(self, obj: str, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> bytes:
        fields = {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}
        return _encoder.encode({**fields, "choices": choices, "usage": usage})

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj = self.object + ("" if self.object == "text_completion" else ".chunk")
        return b"data: " + self.body(obj, choices, usage) + b"\n\n"

    async def answer(self, api: ApiContext, choice: MakeChoice) -> HttpResponse:
        """One JSON body: generated, or the response cache's when the model's is enabled and the request
        is deterministic (temperature 0 or a seed); the id and `created` are always this call's own."""

        async def compute() -> tuple[Answer, int]:
            done = await self.whole()
            choices = [choice(i, text, finish) for i, (text, finish) in enumerate(done.texts)]
            answer = (choices, _usage(done.prompt_tokens, done.completion_tokens), done.worker_id)
            return answer, len(_encoder.encode(answer))

        key = generation.cache_key(self.request) if self.rt.config.cache.enabled else None
        if key is not None:
            answer, _ = await api.cache.answer(self.call, self.rt, (self.object, *key), compute)
        else:
            answer, _ = await compute()
        choices, usage, worker = answer
        body = self.body(self.object, choices, usage)
        return json_response(body, headers=[(b"x-inferd-worker", worker.encode())])

    async def events(self, choices: Choices, make: MakeChunk) -> AsyncIterator[bytes]:
        """The SSE body: every choice's pieces as they come (each choice's own order kept). Closing it
        (the client went away mid-stream) closes the choices' stream, which aborts the sequences."""
        try:
            first = [True] * len(choices)
            async with aclosing(choices.stream()) as pieces:
                async for i, text, finish in pieces:
                    yield make(self, i, text, finish, first[i])
                    first[i] = False
            if self.include_usage:
                yield self.chunk([], _usage(choices.prompt_tokens, choices.completion_tokens))
        except ServingError as exc:  # after streaming began: an error event, then the end
            record_stream_error(self.call, exc)
            yield b"data: " + openai_error(exc, status_of(exc)[0]) + b"\n\n"
        yield b"data: [DONE]\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


MakeChunk = Callable[[_TextCall, int, str, "str | None", bool], bytes]
MakeChoice = Callable[[int, str, "str | None"], dict[str, Any]]
Answer = tuple[list[dict[str, Any]], dict[str, int], str]
"""A JSON answer before its id: the choices, the usage, the worker that generated it."""


def _completion_chunk(call: _TextCall, index: int, text: str, finish: str | None, first: bool) -> bytes:
    return call.chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": finish}])


def _chat_chunk(call: _TextCall, index: int, text: str, finish: str | None, first: bool) -> bytes:
    out = b""
    if first:
        role = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        out += call.chunk([role])
    if text:
        delta = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        out += call.chunk([delta])
    if finish is not None:
        out += call.chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}])
    return out
