"""POST /v1/completions and /v1/chat/completions for models served by upstream engines (openai-upstream).

parse (the model name; the body stays the client's, with the upstream's model name and, for streams,
`stream_options.include_usage` so the usage can be counted) -> runtime.send (choice, retry) ->
relay Server-Sent Events one event at a time, or the whole JSON body. A client that disconnects closes
the upstream connection, which cancels the request upstream. Errors inferd decides are in the OpenAI
shape; an upstream's own error answer (4xx, or 5xx with no other upstream to try) passes through as is.
A caller's deadline bounds the whole exchange (sent upstream as the time left): past it, a 504, or once
streaming an error event and the end of the stream; either way the upstream connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec

from inferd.api.asgi import HttpResponse, StreamingResponse
from inferd.api.errors import status_of
from inferd.api.http import decode_json
from inferd.api.middleware import record_stream_error
from inferd.api.openai import openai_error
from inferd.core.call import Call
from inferd.core.disconnect import Departure, until_disconnect
from inferd.errors import ServingError, WorkerDied
from inferd.kinds.upstream.pool import Outcome, classify_status
from inferd.kinds.upstream.reply import UpstreamReply, describe
from inferd.kinds.upstream.runtime import UpstreamRuntime

if TYPE_CHECKING:
    from inferd.api.context import ApiContext

log = logging.getLogger("inferd.upstream")

MAX_EVENT_BYTES = 4 * 1024 * 1024
"""An upstream SSE event larger than this breaks the stream (so one bad upstream cannot grow a buffer)."""
PASSED_HEADERS = (b"retry-after",)
"""Upstream response headers a client may need besides the content type."""


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Body(msgspec.Struct):
    """What the front end reads of an upstream chunk or response: whether it carries text, and usage."""

    choices: list[_Choice] = []
    usage: _Usage | None = None


_request = msgspec.json.Decoder(dict[str, Any])
_body = msgspec.json.Decoder(_Body)
_encoder = msgspec.json.Encoder()


async def forward(
    api: ApiContext, call: Call, rt: UpstreamRuntime, body: bytes, path: str
) -> HttpResponse | StreamingResponse:
    """The call relayed to `rt`'s upstream under its deadline (`call.deadline`)."""
    departure, deadline = call.departure, call.deadline
    req = decode_json(_request, body, "completion request", 'send {"model": ..., ...}')
    stream = req.get("stream") is True
    relay = _Relay(rt, api.clock.now(), client_wants_usage(req), deadline)
    payload = upstream_payload(req, rt.upstream_model, stream)
    reply = await until_disconnect(departure, rt.send(path, payload, deadline))
    if stream and reply.status == 200:
        return StreamingResponse(relay.events(reply, call))
    return await relay.whole(reply, departure)


def client_wants_usage(req: dict[str, Any]) -> bool:
    options = req.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def upstream_payload(req: dict[str, Any], model: str, stream: bool) -> bytes:
    """The client's request as sent upstream: the upstream's model name, and usage asked for on streams
    (the usage-only chunk is dropped again for clients that did not ask for it)."""
    out = {**req, "model": model}
    options = req.get("stream_options")
    if stream and (options is None or isinstance(options, dict)):
        out["stream_options"] = {**(options or {}), "include_usage": True}
    return _encoder.encode(out)


# ---- one forwarded request ----------------------------------------------------------------------------------
class _Relay:
    """Passes one upstream answer to the client and records its token timing and usage."""

    def __init__(
        self, rt: UpstreamRuntime, started: float, wants_usage: bool, deadline: float | None
    ) -> None:
        self.rt = rt
        self.started = self.last_text_at = started
        self.wants_usage = wants_usage
        self.deadline = deadline
        self.first = True

    async def whole(self, reply: UpstreamReply, departure: Departure) -> HttpResponse:
        """A JSON answer (non-streaming, or an error status), read whole, passed through."""
        outcome = Outcome.IGNORABLE
        bound = asyncio.timeout(self.rt.remaining_s(self.deadline))
        try:
            async with bound:
                data = await until_disconnect(departure, reply.response.read())
            outcome = classify_status(reply.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if bound.expired():  # the caller's deadline: closing the connection cancels it upstream
                raise self.rt.deadline_error(f"while {reply.url} answered") from None
            outcome = Outcome.FAILURE
            raise WorkerDied(f"upstream {reply.url} failed while answering: {describe(exc)}") from None
        finally:
            reply.close(outcome)
        if reply.status == 200:
            self._account(data)
            self.rt.metrics.finished(self.rt.clock.now() - self.started)
        headers = [(k, v) for k in PASSED_HEADERS if (v := _header(reply, k)) is not None]
        ctype = _header(reply, b"content-type") or b"application/json"
        return HttpResponse(data, reply.status, ctype, headers)

    def events(self, reply: UpstreamReply, call: Call) -> AsyncIterator[bytes]:
        return _Events(self._relay(reply, call), reply)

    async def _relay(self, reply: UpstreamReply, call: Call) -> AsyncIterator[bytes]:
        """Each upstream SSE event as soon as it is complete. An upstream failure mid-stream, or the
        caller's deadline, ends the stream with an error event and [DONE] (tokens were already sent:
        it cannot be retried)."""
        events = SSESplitter(MAX_EVENT_BYTES)
        outcome = Outcome.IGNORABLE  # until the stream ends one way or the other: the client left
        pieces = reply.response.content.iter_any()
        try:
            while (piece := await self._next_piece(pieces, reply)) is not None:
                for event in events.feed(piece):
                    if self._on_event(event):
                        yield event
            outcome = Outcome.SUCCESS
            self.rt.metrics.finished(self.rt.clock.now() - self.started)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            outcome = Outcome.FAILURE
            died = WorkerDied(f"upstream {reply.url} failed mid-stream: {describe(exc)}")
            record_stream_error(call, died)
            yield _error_event(died)
            yield b"data: [DONE]\n\n"
        except ServingError as exc:  # the caller's deadline (the upstream is not at fault)
            record_stream_error(call, exc)
            yield _error_event(exc)
            yield b"data: [DONE]\n\n"
        finally:
            reply.close(outcome)

    async def _next_piece(self, pieces: AsyncIterator[bytes], reply: UpstreamReply) -> bytes | None:
        """The next bytes of the answer (None at its end), within the caller's deadline."""
        bound = asyncio.timeout(self.rt.remaining_s(self.deadline))
        try:
            async with bound:
                return await anext(pieces, None)
        except TimeoutError:
            if bound.expired():
                raise self.rt.deadline_error(f"while {reply.url} streamed") from None
            raise

    def _on_event(self, event: bytes) -> bool:
        """Record the event's timing and usage; False for the usage chunk of a client that did not ask."""
        data = _data_of(event)
        if data is None or data == b"[DONE]":
            return True
        body = self._account(data)
        if body is None:
            return True
        if any(c.text or (c.delta is not None and c.delta.content) for c in body.choices):
            now = self.rt.clock.now()
            self.rt.metrics.text_event(now - self.last_text_at, self.first)
            self.first, self.last_text_at = False, now
        return self.wants_usage or bool(body.choices) or body.usage is None

    def _account(self, data: bytes) -> _Body | None:
        """The parsed chunk or response, its usage counted; None if it is not a completion at all."""
        try:
            body = _body.decode(data)
        except (msgspec.DecodeError, RecursionError):  # not ours to judge: the bytes pass as they came
            log.debug("model %s: upstream sent an event that is not a completion chunk", self.rt.name)
            return None
        if body.usage is not None:
            self.rt.metrics.usage(body.usage.prompt_tokens, body.usage.completion_tokens)
        return body


class _Events:
    """The SSE body. `aclose` closes the upstream reply even when the body was never iterated (a client
    that left before the first event): an async generator's `finally` would not run then."""

    def __init__(self, inner: AsyncIterator[bytes], reply: UpstreamReply) -> None:
        self.inner = inner
        self.reply = reply

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self.inner)

    async def aclose(self) -> None:
        await self.inner.aclose()  # type: ignore[attr-defined]
        self.reply.close(Outcome.IGNORABLE)


class SSESplitter:
    """Cuts a byte stream into whole Server-Sent Events, each ending with its blank line (kept). Lines end
    with CRLF, LF or a lone CR, as the SSE specification allows. Each byte is scanned once, however small
    the pieces an event arrives in."""

    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        self._buffer = bytearray()
        self._scanned = 0
        """Bytes of the buffer already cut into lines."""
        self._line_start = 0
        """Where the line being read begins: a line terminator found here ends a blank line."""

    def feed(self, piece: bytes) -> list[bytes]:
        buf = self._buffer
        buf += piece
        events: list[bytes] = []
        cut = 0
        while (found := _LINE_END.search(buf, self._scanned)) is not None:
            if found.end() == len(buf) and found.group() == b"\r":  # maybe the first half of a CRLF
                self._scanned = found.start()
                break
            if found.start() == self._line_start:  # a blank line ends the event
                events.append(bytes(buf[cut : found.end()]))
                cut = found.end()
            self._scanned = self._line_start = found.end()
        else:
            self._scanned = len(buf)
        if cut:
            del buf[:cut]
            self._scanned -= cut
            self._line_start -= cut
        if len(buf) > self.max_event_bytes:
            raise ValueError(f"an upstream event exceeds {self.max_event_bytes} bytes")
        return events


_LINE_END = re.compile(rb"\r\n|\n|\r")


def _error_event(exc: ServingError) -> bytes:
    return b"data: " + openai_error(exc, status_of(exc)[0]) + b"\n\n"


def _data_of(event: bytes) -> bytes | None:
    """The data of a one-line `data:` event (what OpenAI-compatible engines send), else None."""
    line = event.strip()
    if not line.startswith(b"data:") or b"\n" in line or b"\r" in line:
        return None
    return line[5:].strip()


def _header(reply: UpstreamReply, name: bytes) -> bytes | None:
    value = reply.response.headers.get(name.decode())
    return None if value is None else value.encode("utf-8", "surrogateescape")  # the bytes aiohttp read
