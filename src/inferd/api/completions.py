"""OpenAI-compatible text generation: POST /v1/completions and POST /v1/chat/completions.

parse -> tokenize -> check the context length (400 before scheduling) -> submit to the model's
LLMRuntime -> stream Server-Sent Events (`data: {json}`, then `data: [DONE]`) or one JSON body
(api/streams.py turns the token streams into text). A client that disconnects aborts its sequence in
the engine.

Length: `max_tokens` (chat: `max_completion_tokens` too); without one, a completion stops at 16 tokens
and a chat answer may use the rest of the context (max_model_len - prompt tokens), as OpenAI's do.

Deadlines: text generation has none by default (a model's default_timeout_ms would cut long answers
short); a caller's X-Request-Timeout-Ms (in (0, max_timeout_ms], as on the OIP route) applies. Past it,
the sequence is aborted in its engine (its KV blocks freed) and the caller gets a 504 with an OpenAI
error object, or, once streaming, an error event and the end of the stream. Models served upstream
forward the time left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from inferd.api import upstream
from inferd.api.asgi import HttpRequest, HttpResponse, StreamingResponse
from inferd.api.errors import status_of
from inferd.api.http import (
    check_content_type,
    decode_json,
    json_response,
    parse_priority,
    read_body,
    request_deadline,
)
from inferd.api.middleware import record_stream_error
from inferd.api.openai import openai_error
from inferd.api.prompts import chat_prompt
from inferd.api.prompts import prompt_text as _prompt_text
from inferd.api.streams import collect, generate, interleave
from inferd.config import ModelConfig
from inferd.core.call import Call
from inferd.errors import BadRequest, DeadlineExceeded, ServingError
from inferd.gateway.quota_layer import reserve_tokens
from inferd.kinds.llm.placement import Generation
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.stream import TokenStream
from inferd.kinds.upstream.runtime import UpstreamRuntime

if TYPE_CHECKING:
    from inferd.api.context import ApiContext

Response = HttpResponse | StreamingResponse
TextRuntime = LLMRuntime | UpstreamRuntime
"""What serves a text route: generated here, or forwarded (an LLM model's fallback is one of these too)."""

DEFAULT_MAX_TOKENS = 16
"""A completion's length without max_tokens (OpenAI's default; a chat answer's is the rest of the context)."""
MAX_CHOICES = 16
"""Most choices (`n`) one request may ask for."""
MAX_SEED = 2**63 - 1 - MAX_CHOICES
"""Choice i samples with seed + i: every one stays a non-negative 64-bit integer."""
TOKENIZE_IN_THREAD_CHARS = 64 * 1024


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
    call.deadline = text_deadline(api, rt.config, call)
    if isinstance(rt, UpstreamRuntime):  # served by external engines
        return await upstream.forward(api, call, rt, body, "/completions")
    req = decode_json(_completion_decoder, body, "completion request", 'send {"model": ..., "prompt": ...}')
    prompt = _prompt_text(req.prompt)
    text = _TextCall(rt, req, call, "text_completion", f"cmpl-{uuid.uuid4().hex}")
    if not req.stream:
        return await text.answer(api, prompt, req.max_tokens, _text_choice)
    streams = await text.start(prompt, req.max_tokens)
    return StreamingResponse(
        text.events(streams, _completion_chunk), headers=worker_header(streams[0])
    )


async def chat_completions(api: ApiContext, call: Call, request: HttpRequest) -> HttpResponse | StreamingResponse:
    body = await _read(api, request)
    primary = text_model(api, call, body, request)
    return await api.answer_with_fallback(call, primary, lambda rt: _chat(api, call, body, rt))


async def _chat(api: ApiContext, call: Call, body: bytes, rt: TextRuntime) -> Response:
    call.deadline = text_deadline(api, rt.config, call)
    if isinstance(rt, UpstreamRuntime):  # served by external engines
        return await upstream.forward(api, call, rt, body, "/chat/completions")
    req = decode_json(
        _chat_decoder, body, "chat completion request", 'send {"model": ..., "messages": [...]}'
    )
    if not req.messages:
        raise BadRequest("messages is empty: send at least one {role, content} message")
    prompt = chat_prompt(rt.tokenizer, rt.name, req.messages)
    text = _TextCall(rt, req, call, "chat.completion", f"chatcmpl-{uuid.uuid4().hex}")
    max_tokens = req.max_completion_tokens or req.max_tokens
    if not req.stream:
        return await text.answer(api, prompt, max_tokens, _chat_choice)
    streams = await text.start(prompt, max_tokens)
    return StreamingResponse(
        text.events(streams, _chat_chunk), headers=worker_header(streams[0])
    )


def _text_choice(i: int, text: str, finish: str | None) -> dict[str, Any]:
    return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}


def _chat_choice(i: int, text: str, finish: str | None) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {"index": i, "message": message, "finish_reason": finish, "logprobs": None}


def text_model(api: ApiContext, call: Call, body: bytes, request: HttpRequest) -> LLMRuntime | UpstreamRuntime:
    """The model the request names: generated here (LLMRuntime) or forwarded (UpstreamRuntime)."""
    name = decode_json(_named, body, "completion request", 'send {"model": ..., ...}').model
    rt = api.text_model(call, name, request)
    if not isinstance(rt, LLMRuntime | UpstreamRuntime):
        raise BadRequest(f"model {name!r} is a {rt.kind} model: it does not generate text")
    return rt


def text_deadline(api: ApiContext, config: ModelConfig, call: Call) -> float | None:
    """The caller's deadline (`call.timeout_ms`: X-Request-Timeout-Ms); text generation gets no default
    deadline, so a long answer is never cut short unless the caller asks."""
    return request_deadline(api.clock, config.max_timeout_ms, None, call.timeout_ms, None)


def worker_header(stream: TokenStream) -> list[tuple[bytes, bytes]]:
    """X-Inferd-Worker: the worker that generated the response (the last one, after a failover),
    so callers and tests can see where routing placed a request."""
    return [(b"x-inferd-worker", stream.worker_id.encode())]


async def _read(api: ApiContext, request: HttpRequest) -> bytes:
    check_content_type(request, ("application/json", ""))
    return await read_body(request, api.max_body)


# ---- one call ---------------------------------------------------------------------------------------------
class _TextCall:
    """One generation request: its runtime, its parameters and how its chunks are named."""

    def __init__(self, rt: LLMRuntime, req: CompletionRequest | ChatRequest, call: Call, obj: str, cid: str):
        self.rt = rt
        self.req = req
        self.call = call
        self.deadline = call.deadline
        self.chat = isinstance(req, ChatRequest)
        self.what = "messages" if self.chat else "prompt"
        self.object = obj
        self.id = cid
        self.created = int(time.time())
        stop = req.stop
        self.stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]

    async def start(self, prompt: str, max_tokens: int | None) -> list[TokenStream]:
        """Tokenize, check and submit one sequence per choice (`n`). A chat prompt is a rendered chat
        template whose control tokens must parse as such (a raw completion prompt's text never does).
        Choice i samples with seed + i (or unseeded when the request has no seed)."""
        if not 1 <= self.req.n <= MAX_CHOICES:
            raise BadRequest(f"n must be between 1 and {MAX_CHOICES}, got {self.req.n}")
        gen = self.generation(max_tokens)
        if len(prompt) > TOKENIZE_IN_THREAD_CHARS:
            ids = await asyncio.to_thread(self.rt.tokenizer.encode, prompt, self.chat)
        else:
            ids = self.rt.tokenizer.encode(prompt, self.chat)
        if not ids:
            raise BadRequest(f"the {self.what} is empty: it holds no tokens")
        if max_tokens is None:
            gen = dataclasses.replace(gen, max_tokens=self.default_max_tokens(len(ids)))
        self.rt.check_context(len(ids), gen.max_tokens, self.what)
        if self.deadline is not None and self.rt.clock.now() >= self.deadline:
            raise DeadlineExceeded(f"the request's deadline passed before its {self.what} was scheduled")
        streams: list[TokenStream] = []
        await reserve_tokens(self.call, len(ids) + self.req.n * gen.max_tokens, streams)
        try:
            for i in range(self.req.n):
                seed = None if gen.seed is None else gen.seed + i
                streams.append(self.rt.submit(ids, dataclasses.replace(gen, seed=seed)))
        except Exception:  # all choices or none: a refused one takes the accepted ones with it
            for stream in streams:
                self.rt.abort(stream, client_gone=False)
            raise
        return streams

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """Without max_tokens: a chat answer may fill the rest of the context; a completion stops at 16."""
        if self.chat:
            return max(1, self.rt.max_model_len - prompt_tokens)
        return DEFAULT_MAX_TOKENS

    def generation(self, max_tokens: int | None) -> Generation:
        """The request's sampling and scheduling parameters, checked (400 naming the bad one); without
        max_tokens, a placeholder that `default_max_tokens` replaces once the prompt is tokenized."""
        req = self.req
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}")
        temperature = 1.0 if req.temperature is None else req.temperature
        if not 0.0 <= temperature <= 2.0:
            raise BadRequest(f"temperature must be between 0 and 2, got {temperature}")
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0.0 < top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
        seed = req.seed
        if seed is not None and seed < 0:
            seed = None  # -1 and other negatives mean "no seed" (llama.cpp's convention)
        if seed is not None and seed > MAX_SEED:
            raise BadRequest(f"seed must be at most {MAX_SEED} (or negative for none), got {seed}")
        tenant = self.call.tenant  # one value: the prefix-cache salt and the fairness lane
        if req.priority is not None:  # else X-Priority's, or interactive
            self.call.priority = parse_priority(req.priority, None)
        return Generation(
            max_tokens=max_tokens,
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            priority=self.call.priority,
            tenant=tenant.name,
            weight=tenant.config.weight,
            ignore_eos=req.ignore_eos,
            deadline=self.deadline,
        )

    @property
    def include_usage(self) -> bool:
        return self.req.stream_options is not None and self.req.stream_options.include_usage

    def usage(self, streams: list[TokenStream]) -> dict[str, int]:
        prompt = streams[0].prompt_tokens
        done = sum(s.completion_tokens for s in streams)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def body(self, obj: str, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> bytes:
        fields = {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}
        return _encoder.encode({**fields, "choices": choices, "usage": usage})

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj = self.object + ("" if self.object == "text_completion" else ".chunk")
        return b"data: " + self.body(obj, choices, usage) + b"\n\n"

    async def answer(
        self, api: ApiContext, prompt: str, max_tokens: int | None, choice: MakeChoice
    ) -> HttpResponse:
        """One JSON body: generated, or the response cache's when the model's is enabled and the request
        is deterministic (temperature 0 or a seed); the id and `created` are always this call's own."""

        async def compute() -> tuple[Answer, int]:
            streams = await self.start(prompt, max_tokens)
            texts = await collect(self.rt, streams, self.stops, self.call.departure)
            choices = [choice(i, text, finish) for i, (text, finish) in enumerate(texts)]
            answer = (choices, self.usage(streams), streams[0].worker_id)
            return answer, len(_encoder.encode(answer))

        req = self.req
        if self.rt.config.cache.enabled and (
            req.temperature == 0 or (req.seed is not None and req.seed >= 0)
        ):
            g = self.generation(max_tokens)  # what changes the text; never the deadline or priority
            canonical = (self.object, prompt, max_tokens, g.seed, g.temperature, g.top_p, g.ignore_eos)
            canonical += (req.n, self.stops)
            answer, _ = await api.cache.answer(self.call, self.rt, canonical, compute)
        else:
            answer, _ = await compute()
        choices, usage, worker = answer
        body = self.body(self.object, choices, usage)
        return json_response(body, headers=[(b"x-inferd-worker", worker.encode())])

    async def events(self, streams: list[TokenStream], make: MakeChunk) -> AsyncIterator[bytes]:
        """The SSE body: every choice's pieces as they come (each choice's own order kept). Its
        `finally` aborts the sequences when the client went away mid-stream."""
        client_gone = True  # until the body ends on its own
        try:
            first = [True] * len(streams)
            pieces = [generate(self.rt, s, self.stops) for s in streams]
            async for i, (text, finish) in interleave(pieces):
                yield make(self, i, text, finish, first[i])
                first[i] = False
            if self.include_usage:
                yield self.chunk([], self.usage(streams))
            client_gone = False
        except ServingError as exc:  # after streaming began: an error event, then the end
            client_gone = False  # the other choices end because this one failed, not the client
            record_stream_error(self.call, exc)
            yield b"data: " + openai_error(exc, status_of(exc)[0]) + b"\n\n"
        finally:
            for stream in streams:
                self.rt.abort(stream, client_gone=client_gone)
        yield b"data: [DONE]\n\n"


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
