"""OpenAI-compatible text generation: POST /v1/completions and POST /v1/chat/completions.

parse -> tokenize -> check the context length (400 before scheduling) -> submit to the model's
LLMRuntime -> stream Server-Sent Events (`data: {json}`, then `data: [DONE]`) or one JSON body.
Stop strings are matched on the front end, on the generated text; reaching one aborts the sequence.
A client that disconnects aborts its sequence in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from inferd.api import upstream
from inferd.api.asgi import HttpRequest, HttpResponse, StreamingResponse
from inferd.api.errors import status_of
from inferd.api.http import (
    ClientGone,
    check_content_type,
    decode_json,
    json_response,
    parse_priority,
    read_body,
)
from inferd.api.openai import openai_error
from inferd.errors import BadRequest, ModelError, NotFound, ServingError, WorkerUnavailable
from inferd.llm.runtime import Generation, LLMRuntime
from inferd.llm.stream import TokenStream

if TYPE_CHECKING:
    from inferd.api.app import Api
    from inferd.server import InferenceServer

DEFAULT_MAX_TOKENS = 16
T = TypeVar("T")
MAX_CHOICES = 16
MAX_SEED = 2**63 - 1 - MAX_CHOICES
"""Choice i samples with seed + i: every one stays a non-negative 64-bit integer."""
"""Most choices (`n`) one request may ask for."""
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


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatRequest)
_encoder = msgspec.json.Encoder()


# ---- handlers -------------------------------------------------------------------------------------------
async def completions(api: Api, request: HttpRequest) -> HttpResponse | StreamingResponse:
    body = await _read(api, request)
    if (up := upstream.upstream_for(api.server, body)) is not None:  # served by external engines
        return await upstream.forward(api, request, up, body, "/completions")
    req = decode_json(_completion_decoder, body, "completion request", 'send {"model": ..., "prompt": ...}')
    rt = llm_runtime(api.server, req.model)
    prompt = _prompt_text(req.prompt)
    call = _Call(rt, req, request, "prompt", "text_completion", f"cmpl-{uuid.uuid4().hex}")
    streams = await call.start(prompt, req.max_tokens)
    if req.stream:
        return StreamingResponse(
            call.events(streams, _completion_chunk), request.receive, headers=worker_header(streams[0])
        )
    texts = await _collect(call, streams, request)
    choices = [
        {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        for i, (text, finish) in enumerate(texts)
    ]
    return call.response(choices, streams)


async def chat_completions(api: Api, request: HttpRequest) -> HttpResponse | StreamingResponse:
    body = await _read(api, request)
    if (up := upstream.upstream_for(api.server, body)) is not None:  # served by external engines
        return await upstream.forward(api, request, up, body, "/chat/completions")
    req = decode_json(
        _chat_decoder, body, "chat completion request", 'send {"model": ..., "messages": [...]}'
    )
    rt = llm_runtime(api.server, req.model)
    if not req.messages:
        raise BadRequest("messages is empty: send at least one {role, content} message")
    prompt = rt.tokenizer.chat_prompt([{"role": m.role, "content": m.content} for m in req.messages])
    call = _Call(rt, req, request, "messages", "chat.completion", f"chatcmpl-{uuid.uuid4().hex}")
    streams = await call.start(prompt, req.max_completion_tokens or req.max_tokens, special=True)
    if req.stream:
        return StreamingResponse(
            call.events(streams, _chat_chunk), request.receive, headers=worker_header(streams[0])
        )
    texts = await _collect(call, streams, request)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": None,
        }
        for i, (text, finish) in enumerate(texts)
    ]
    return call.response(choices, streams)


def llm_runtime(server: InferenceServer, name: str) -> LLMRuntime:
    rt = server.llm_runtimes.get(name)
    if rt is not None:
        return rt
    if name in server.runtimes:
        raise BadRequest(f"model {name!r} does not generate text; text models: {sorted(server.llm_runtimes)}")
    raise NotFound(f"unknown model {name!r}; text models served: {sorted(server.llm_runtimes)}")


def worker_header(stream: TokenStream) -> list[tuple[bytes, bytes]]:
    """X-Inferd-Worker: the worker that generated the response (the last one, after a failover),
    so callers and tests can see where routing placed a request."""
    return [(b"x-inferd-worker", stream.worker_id.encode())]


async def _read(api: Api, request: HttpRequest) -> bytes:
    check_content_type(request, ("application/json", ""))
    return await read_body(request, api.max_body)


def _prompt_text(prompt: str | list[Any]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise BadRequest("prompt must be one string (lists of prompts and token ids are not supported yet)")


# ---- one call ---------------------------------------------------------------------------------------------
class _Call:
    """One generation request: its runtime, its parameters and how its chunks are named."""

    def __init__(
        self,
        rt: LLMRuntime,
        req: CompletionRequest | ChatRequest,
        request: HttpRequest,
        what: str,
        obj: str,
        cid: str,
    ):
        self.rt = rt
        self.req = req
        self.request = request
        self.what = what
        self.object = obj
        self.id = cid
        self.created = int(time.time())
        stop = req.stop
        self.stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]

    async def start(self, prompt: str, max_tokens: int | None, special: bool = False) -> list[TokenStream]:
        """Tokenize, check and submit one sequence per choice (`n`). `special`: the prompt is a rendered
        chat template whose control tokens must parse as such (a raw completion prompt's text never
        does). Choice i samples with seed + i (or unseeded when the request has no seed)."""
        if not 1 <= self.req.n <= MAX_CHOICES:
            raise BadRequest(f"n must be between 1 and {MAX_CHOICES}, got {self.req.n}")
        gen = self.generation(DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
        if len(prompt) > TOKENIZE_IN_THREAD_CHARS:
            ids = await asyncio.to_thread(self.rt.tokenizer.encode, prompt, special)
        else:
            ids = self.rt.tokenizer.encode(prompt, special)
        if not ids:
            raise BadRequest(f"the {self.what} is empty: it holds no tokens")
        self.rt.check_context(len(ids), gen.max_tokens, self.what)
        streams: list[TokenStream] = []
        try:
            for i in range(self.req.n):
                seed = None if gen.seed is None else gen.seed + i
                streams.append(self.rt.submit(ids, dataclasses.replace(gen, seed=seed)))
        except Exception:  # all choices or none: a refused one takes the accepted ones with it
            for stream in streams:
                self.rt.abort(stream, client_gone=False)
            raise
        return streams

    def generation(self, max_tokens: int) -> Generation:
        """The request's sampling and scheduling parameters, checked (400 naming the bad one)."""
        req = self.req
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
        tenant = self.request.header(b"x-tenant") or ""
        if len(tenant) > 256:
            raise BadRequest(f"X-Tenant is {len(tenant)} characters long; at most 256")
        return Generation(
            max_tokens=max_tokens,
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            priority=parse_priority(req.priority, self.request.header(b"x-priority")),
            tenant=tenant,
            ignore_eos=req.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return self.req.stream_options is not None and self.req.stream_options.include_usage

    def usage(self, streams: list[TokenStream]) -> dict[str, int]:
        prompt = streams[0].prompt_tokens
        done = sum(s.completion_tokens for s in streams)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        body = {
            "id": self.id,
            "object": self.object + ("" if self.object == "text_completion" else ".chunk"),
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            "usage": usage,
        }
        return b"data: " + _encoder.encode(body) + b"\n\n"

    def response(self, choices: list[dict[str, Any]], streams: list[TokenStream]) -> HttpResponse:
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            "usage": self.usage(streams),
        }
        return json_response(_encoder.encode(body), headers=worker_header(streams[0]))

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
            yield b"data: " + openai_error(exc, status_of(exc)[0]) + b"\n\n"
        finally:
            for stream in streams:
                self.rt.abort(stream, client_gone=client_gone)
        yield b"data: [DONE]\n\n"


MakeChunk = Callable[[_Call, int, str, "str | None", bool], bytes]


def _completion_chunk(call: _Call, index: int, text: str, finish: str | None, first: bool) -> bytes:
    return call.chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": finish}])


def _chat_chunk(call: _Call, index: int, text: str, finish: str | None, first: bool) -> bytes:
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


async def interleave(iters: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) from several async iterators as items arrive; an iterator's error ends it all."""
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iters[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _collect(call: _Call, streams: list[TokenStream], request: HttpRequest) -> list[tuple[str, str]]:
    """Every choice's whole completion, for a non-streaming request; a disconnect aborts the sequences
    (499)."""

    async def gather(stream: TokenStream) -> tuple[str, str]:
        parts, finish = [], "length"
        async for text, reason in generate(call.rt, stream, call.stops):
            parts.append(text)
            finish = reason or finish
        return "".join(parts), finish

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(asyncio.gather(*(gather(s) for s in streams), return_exceptions=True))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = not work.done()  # the disconnect watch (or a cancellation) ended the wait
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
        for stream in streams:
            call.rt.abort(stream, client_gone=gone)
    if work.cancelled():
        raise ClientGone()
    results = work.result()
    for r in results:  # every choice was awaited, so no failure goes unretrieved; the first one answers
        if isinstance(r, BaseException):
            raise r
    return results


# ---- tokens -> text ---------------------------------------------------------------------------------------
async def generate(
    rt: LLMRuntime, stream: TokenStream, stops: list[str]
) -> AsyncIterator[tuple[str, str | None]]:
    """(text, finish_reason) pieces of one sequence's output, cut at the first stop string."""
    checker = StopChecker(stops)
    text_of = rt.tokenizer.detokenizer()
    while True:
        chunk = await stream.next()
        text = text_of.feed(chunk.token_ids) if chunk.token_ids else ""
        if chunk.finish_reason is not None:
            text += text_of.flush()
        emit, stopped = checker.feed(text)
        if stopped:
            rt.abort(stream, client_gone=False)
            yield emit, "stop"
            return
        if chunk.finish_reason is not None:
            yield emit + checker.rest(), _finish_reason(chunk.finish_reason)
            return
        if emit:
            yield emit, None


def _finish_reason(reason: str) -> str:
    if reason in ("stop", "length"):
        return reason
    if reason == "abort":
        raise WorkerUnavailable("the engine aborted the sequence (shutting down or preempted away)")
    raise ModelError("the model failed while generating this sequence")


class StopChecker:
    """Finds the first stop string in text that arrives in pieces; holds back a possible partial match."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stops) if i >= 0]
        if hits:
            out = self.text[self.emitted : min(hits)]
            self.emitted = len(self.text)
            return out, True
        safe = max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : safe]
        self.emitted = safe
        return out, False

    def rest(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
