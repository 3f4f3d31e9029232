"""The open-loop LLM load generator: `run_llm_load(spec) -> LLMLoadReport`.

Each planned request is sent at its intended time whatever the server is doing, as a streaming
`POST /v1/completions` on its own connection, and every Server-Sent Event is timestamped as its bytes
arrive (httptools parses the HTTP framing; nothing waits for the whole body). With `protocol` grpc it is
one `ModelStreamInfer` stream instead, its responses timed the same way (`inferd.bench.grpc_llm`). Times
count from the intended send time (see `inferd.bench.llm_report` for the definitions and the goodput
rule).

For sim-llm every stream is checked: its text must be `sim_llm_tokens(prompt, seed, max_tokens)`
joined by spaces, and the usage chunk must count exactly `max_tokens` tokens (gRPC has no usage chunk:
its text alone is checked, and a stream whose text is right carried max_tokens tokens, however many
responses the server merged them into). An unchecked gRPC stream counts its text-carrying responses.

Everything is bounded: the number of requests (planned up front), the streams open at once
(`connections`), each request's time (`timeout_s` from its intended time, then a hard stop for the
run), and each stream's buffers (a stream with more chunks than it asked tokens for is cut off).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
import msgspec

from inferd.bench.grpc_llm import GrpcStreamClient, SharedStreamsClient
from inferd.bench.http_clients import HttpProtocolError
from inferd.bench.llm_report import (
    MISMATCH_KINDS,
    SLO,
    LLMLoadReport,
    LLMPhaseReport,
    LLMRecorder,
    StreamTiming,
)
from inferd.bench.llm_workload import LLMLoadSpec, PlannedRequest, completion_body, plan_requests
from inferd.bench.open_loop import run_blocking, sleep_until
from inferd.kinds.llm.sim_llm import sim_llm_tokens

_MAX_EVENT_BYTES = 1 << 20
_MAX_ERROR_BODY = 64 * 1024
_EXTRA_CHUNKS = 16
"""Chunks a stream may carry beyond one per asked token (role/usage/finish chunks) before it is cut."""


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Event(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | None = None


_decode_event = msgspec.json.Decoder(_Event).decode


class SSEStream:
    """One response body as Server-Sent Events: arrival times of text chunks, the text, the usage count,
    and how it ended. Fed bytes as they arrive; holds at most `max_chunks` text chunks."""

    def __init__(self, max_chunks: int) -> None:
        self.max_chunks = max_chunks
        self.chunk_times: list[float] = []
        self.text: list[str] = []
        self.completion_tokens: int | None = None
        self.done_at: float | None = None
        """When `data: [DONE]` arrived."""
        self.error: str | None = None
        """'stream_error' (an error event), 'bad_response' (not SSE JSON) or 'overlong'."""
        self._buf = bytearray()

    def feed(self, data: bytes, now: float) -> None:
        if self.error is not None or self.done_at is not None:
            return
        self._buf += data
        while (end := self._buf.find(b"\n\n")) >= 0:
            raw = bytes(self._buf[:end])
            del self._buf[: end + 2]
            self._event(raw, now)
            if self.error is not None or self.done_at is not None:
                return
        if len(self._buf) > _MAX_EVENT_BYTES:
            self.error = "bad_response"

    def _event(self, raw: bytes, now: float) -> None:
        for line in raw.split(b"\n"):
            line = line.rstrip(b"\r")
            if not line.startswith(b"data:"):
                continue  # comments, event names, ids
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done_at = now
                return
            try:
                event = _decode_event(payload)
            except msgspec.DecodeError:
                self.error = "bad_response"
                return
            if event.error is not None:
                self.error = "stream_error"
                return
            if event.usage is not None:
                self.completion_tokens = event.usage.completion_tokens
            text = "".join(c.text for c in event.choices)
            if text:
                self.add_text(text, now)

    def add_text(self, text: str, now: float) -> None:
        """A chunk carrying text, arrived at `now`."""
        if len(self.chunk_times) >= self.max_chunks:
            self.error = "overlong"
            return
        self.chunk_times.append(now)
        self.text.append(text)


class _StreamConnection(asyncio.Protocol):
    """One request on its own connection; body bytes go to the SSEStream, timestamped on arrival."""

    def __init__(self, request: bytes, stream: SSEStream, now: Callable[[], float]) -> None:
        self._request = request
        self._stream = stream
        self._now = now
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self.status = 0
        self.error_body = bytearray()
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(HttpProtocolError(f"bad HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionResetError("connection closed before the response was complete"))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status == 200:
            self._stream.feed(body, self._now())
        elif len(self.error_body) < _MAX_ERROR_BODY:
            self.error_body += body[: _MAX_ERROR_BODY - len(self.error_body)]

    def on_message_complete(self) -> None:
        if not self.finished.done():
            self.finished.set_result(None)
        self.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _fail(self, exc: BaseException) -> None:
        if not self.finished.done():
            self.finished.set_exception(exc)
        if self._transport is not None:
            self._transport.abort()


class CompletionsClient:
    """Streams one completion per connection (`Connection: close`), so a late or abandoned stream can
    never be read as another request's."""

    def __init__(self, spec: LLMLoadSpec, now: Callable[[], float]) -> None:
        self._spec = spec
        parts = urlsplit(spec.url.rstrip("/") + "/v1/completions")
        self._host = parts.hostname or ""
        self._port = parts.port or 80
        self._now = now
        head = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            "Accept: text/event-stream\r\nConnection: close\r\n"
        )
        if spec.priority is not None:
            head += f"X-Priority: {spec.priority}\r\n"
        self._head = head.encode("latin-1")

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def stream(self, req: PlannedRequest, stream: SSEStream) -> str | None:
        """Send the request and feed its body into `stream`; once the body is complete, None when the
        status is 200, else the error kind `http_<status>`."""
        body = completion_body(self._spec, req)
        request = b"%sContent-Length: %d\r\n\r\n%s" % (self._head, len(body), body)
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: _StreamConnection(request, stream, self._now), self._host, self._port
        )
        try:
            await conn.finished
        finally:
            conn.close()  # also on cancellation: the server sees the disconnect and aborts the sequence
            if not conn.finished.done():
                conn.finished.cancel()  # nobody will read a late failure
        return None if conn.status == 200 else f"http_{conn.status}"


LLMClient = CompletionsClient | GrpcStreamClient | SharedStreamsClient


def make_client(spec: LLMLoadSpec, now: Callable[[], float]) -> LLMClient:
    """SSE, or over gRPC a stream per request or requests shared by `spec.streams` streams."""
    if spec.protocol != "grpc":
        return CompletionsClient(spec, now)
    return SharedStreamsClient(spec, now) if spec.streams else GrpcStreamClient(spec, now)


def check_sim_stream(req: PlannedRequest, text: str, tokens: int) -> str:
    """'ok', 'wrong_length' (usage is not max_tokens) or 'wrong_text' (not sim-llm's documented words)."""
    if tokens != req.max_tokens:
        return "wrong_length"
    expected = " ".join(sim_llm_tokens(req.prompt, req.seed, req.max_tokens))
    return "ok" if text == expected else "wrong_text"


@dataclass
class _Run:
    """One run's moving parts, owned by `run_llm_load`."""

    spec: LLMLoadSpec
    client: LLMClient
    now: Callable[[], float]
    t0: float
    warmup: LLMRecorder
    measured: LLMRecorder
    slots: asyncio.Semaphore
    loop_skew: float
    sent: int = 0

    async def dispatch(self, plan: list[PlannedRequest], tg: asyncio.TaskGroup) -> None:
        """Start each request at its intended time; never wait for answers before sending."""
        now = self.now
        for req in plan:
            intended = self.t0 + req.offset_s
            await sleep_until(intended, now)
            rec = self.measured if req.offset_s >= self.spec.warmup_s else self.warmup
            tg.create_task(self.one(req, intended, rec))
            self.sent += 1

    async def one(self, req: PlannedRequest, intended: float, rec: LLMRecorder) -> None:
        rec.send_lag(self.now() - intended)
        stream = SSEStream(max_chunks=req.max_tokens + _EXTRA_CHUNKS)
        try:
            async with asyncio.timeout_at(intended + self.spec.timeout_s + self.loop_skew), self.slots:
                failed = await self.client.stream(req, stream)
        except TimeoutError:
            rec.error("timeout")
        except OSError:
            rec.error("connection")
        except asyncio.CancelledError:
            rec.error("timeout")  # the run's hard stop
            raise
        else:
            self.settle(req, intended, failed, stream, rec)

    def settle(
        self, req: PlannedRequest, intended: float, failed: str | None, stream: SSEStream, rec: LLMRecorder
    ) -> None:
        """Classify a finished response and record it."""
        if failed is not None:
            rec.error(failed)
            return
        if stream.error in MISMATCH_KINDS:
            rec.mismatch(stream.error)
            return
        if stream.error is not None:
            rec.error(stream.error)
            return
        if stream.done_at is None or not stream.chunk_times:
            rec.error("incomplete")
            return
        tokens = stream.completion_tokens
        if self.spec.check:
            # No usage count (gRPC has none): the text alone is checked, and it is max_tokens tokens.
            tokens = req.max_tokens if tokens is None else tokens
            verdict = check_sim_stream(req, "".join(stream.text), tokens)
            if verdict != "ok":
                rec.mismatch(verdict)
                return
        if tokens is None:
            tokens = len(stream.chunk_times)  # a lower bound where the server merged pieces
        times = [t - intended for t in stream.chunk_times]
        timing = StreamTiming.from_chunk_times(times, stream.done_at - intended, tokens)
        rec.ok(timing, req.prompt_tokens, stream.done_at)


async def run_llm_load(spec: LLMLoadSpec) -> LLMLoadReport:
    """Offer `spec`'s load open-loop and return what happened in the measured window."""
    plan = plan_requests(spec)
    slo = SLO(spec.ttft_slo_ms, spec.itl_slo_ms)
    cpu0 = time.process_time()
    now = time.monotonic  # not loop.time(): uvloop's is whole milliseconds and cached per iteration
    loop = asyncio.get_running_loop()
    client = make_client(spec, now)
    try:
        await client.start()
        t0 = now() + 0.01
        run = _Run(
            spec,
            client,
            now,
            t0,
            warmup=LLMRecorder(slo, t0, spec.warmup_s or 1.0),
            measured=LLMRecorder(slo, t0 + spec.warmup_s, spec.duration_s),
            slots=asyncio.Semaphore(spec.connections),
            loop_skew=loop.time() - now(),
        )
        hard_stop = t0 + spec.total_s + spec.timeout_s + spec.grace_s
        async with asyncio.timeout_at(hard_stop + run.loop_skew), asyncio.TaskGroup() as tg:
            await run.dispatch(plan, tg)
    except TimeoutError:
        pass  # outstanding streams were cancelled and counted as timeouts
    finally:
        await client.close()
    return LLMLoadReport(
        spec=spec.to_dict(),
        scheduled=len(plan),
        sent=run.sent,
        elapsed_s=now() - t0,
        generator_cpu_s=time.process_time() - cpu0,
        measured=LLMPhaseReport.from_recorder(run.measured),
        warmup=LLMPhaseReport.from_recorder(run.warmup) if spec.warmup_s > 0 else None,
    )


def run_llm_load_blocking(spec: LLMLoadSpec) -> LLMLoadReport:
    """Run `run_llm_load` on a fresh event loop (uvloop when installed)."""
    return run_blocking(run_llm_load(spec))
