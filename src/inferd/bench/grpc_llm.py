"""`inferd bench-llm --protocol grpc`: each planned request as one `ModelStreamInfer` stream carrying
Triton's vLLM-backend tensors, its responses timed as they arrive, as the SSE mode times its chunks.

The request: `text_input` BYTES (the prompt), `stream` BOOL true, `sampling_parameters` BYTES holding
JSON (max_tokens, temperature, seed), `exclude_input_in_output` BOOL true, each [1], in
`raw_input_contents`. Each response is a `ModelStreamInferResponse`: one carrying text (`text_output`)
is a chunk (TTFT is the first, ITL the gaps between them), `error_message` ends the request as a stream
error (`grpc_<code>` when the message names its status as inferd's edge does, "[StatusCode.X] ..."),
and the one whose `parameters.triton_final_response` is true ends it. The client then half-closes
the stream and expects it to end with OK and nothing more; a response with another request's id is a
misrouted answer (`wrong_id`).

One stream per request over a few channels (one HTTP/2 connection each), as the SSE mode opens one
connection per request: a late or abandoned stream can never be read as another request's, and
cancelling it (the client's deadline) resets only its own stream, which the server must see as the
caller gone. With `streams` N (`--streams N`), every request goes on one of N long-lived streams instead
and answers are matched by id (`SharedStreamsClient`), as tritonclient's `start_stream` sends them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import Callable
from typing import Protocol

import grpc

from inferd.bench.grpc_infer import GrpcChannels, bytes_element, error_kind, is_connect_failure
from inferd.bench.llm_workload import LLMLoadSpec, PlannedRequest
from inferd.grpc_edge.protos import grpc_service_pb2 as pb

STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
_TRUE = b"\x01"


class TextChunks(Protocol):
    """Where a stream's pieces go (`inferd.bench.llm_loadgen.SSEStream`)."""

    done_at: float | None
    error: str | None

    def add_text(self, text: str, now: float) -> None: ...


def llm_request(model: str, rid: str, req: PlannedRequest, temperature: float) -> bytes:
    """The serialized ModelInferRequest of one planned request, with the vLLM backend's tensors."""
    params = {"max_tokens": req.max_tokens, "temperature": temperature, "seed": req.seed}
    msg = pb.ModelInferRequest(model_name=model, id=rid)
    for name, datatype in (
        ("text_input", "BYTES"),
        ("stream", "BOOL"),
        ("sampling_parameters", "BYTES"),
        ("exclude_input_in_output", "BOOL"),
    ):
        msg.inputs.add(name=name, datatype=datatype, shape=[1])
    msg.raw_input_contents.extend(
        (
            bytes_element(req.prompt.encode()),
            _TRUE,
            bytes_element(json.dumps(params, separators=(",", ":")).encode()),
            _TRUE,
        )
    )
    return msg.SerializeToString()


def bytes_elements(blob: bytes) -> list[bytes]:
    """Every element of a raw BYTES tensor; ValueError when a length prefix runs past the blob."""
    out, at = [], 0
    while at < len(blob):
        if at + 4 > len(blob):
            raise ValueError("truncated length prefix")
        n = int.from_bytes(blob[at : at + 4], "little")
        if at + 4 + n > len(blob):
            raise ValueError("truncated element")
        out.append(blob[at + 4 : at + 4 + n])
        at += 4 + n
    return out


def response_text(resp: pb.ModelInferResponse) -> str:
    """The text_output of one response ('' when it carries none); ValueError when it is malformed."""
    for i, out in enumerate(resp.outputs):
        if out.name != "text_output":
            continue
        if i < len(resp.raw_output_contents):
            pieces = bytes_elements(resp.raw_output_contents[i])
        else:
            pieces = list(out.contents.bytes_contents)
        return b"".join(pieces).decode()
    return ""


_STATUS = re.compile(r"^\[StatusCode\.([A-Z_]+)\]")


def stream_error_kind(message: str) -> str:
    """`grpc_<code>` for an error response naming its status as inferd's edge does
    ("[StatusCode.RESOURCE_EXHAUSTED] ..."), else 'stream_error'."""
    m = _STATUS.match(message)
    return f"grpc_{m.group(1).lower()}" if m else "stream_error"


def parse(raw: bytes) -> pb.ModelStreamInferResponse | None:
    """A ModelStreamInferResponse, or None when the bytes are not one."""
    try:
        return pb.ModelStreamInferResponse.FromString(raw)
    except Exception:  # protobuf's DecodeError (upb raises its own)
        return None


def feed(rid: str, raw: bytes, now: float, stream: TextChunks) -> None:
    """One serialized ModelStreamInferResponse into `stream` (`feed_message`)."""
    msg = parse(raw)
    if msg is None:
        stream.error = "bad_response"
        return
    feed_message(rid, msg, now, stream)


def feed_message(rid: str, msg: pb.ModelStreamInferResponse, now: float, stream: TextChunks) -> None:
    """One response into `stream`: a text chunk, its end, or what went wrong."""
    if msg.error_message:
        stream.error = stream_error_kind(msg.error_message)
        return
    resp = msg.infer_response
    if resp.id != rid:
        stream.error = "wrong_id"
        return
    try:
        text = response_text(resp)
    except ValueError:  # a bad length prefix, or not UTF-8
        stream.error = "bad_response"
        return
    if text:
        stream.add_text(text, now)
    final = resp.parameters.get("triton_final_response")
    if stream.error is None and final is not None and final.bool_param:
        stream.done_at = now


class GrpcStreamClient:
    """Streams one planned request per ModelStreamInfer call; `stream(req, chunks)` -> None when the
    stream ended as it should, else the error kind (`grpc_<code>`)."""

    def __init__(self, spec: LLMLoadSpec, now: Callable[[], float]) -> None:
        self._model = spec.model
        self._seed = spec.seed
        self._temperature = spec.temperature
        self._metadata = (("x-priority", spec.priority),) if spec.priority is not None else ()
        self._now = now
        self._pool = GrpcChannels(spec.url, spec.channels)
        calls = [ch.stream_stream(STREAM_METHOD) for ch in self._pool.channels]  # bytes in, bytes out
        self._next = itertools.cycle(calls).__next__

    async def start(self) -> None:
        await self._pool.connect(1.0)

    async def close(self) -> None:
        await self._pool.close()

    async def stream(self, req: PlannedRequest, chunks: TextChunks) -> str | None:
        rid = f"{self._seed}-{req.i}"
        call = self._next()(metadata=self._metadata)
        try:
            await call.write(llm_request(self._model, rid, req, self._temperature))
            while chunks.done_at is None and chunks.error is None:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    return None  # ended before its final response: the caller counts it incomplete
                feed(rid, raw, self._now(), chunks)
            if chunks.error is not None:
                return None
            await call.done_writing()
            if await call.read() is not grpc.aio.EOF:
                chunks.error = "overlong"  # something after the final response
            return None
        except grpc.aio.AioRpcError as exc:
            if is_connect_failure(exc):
                raise ConnectionError(exc.details()) from exc
            return error_kind(exc)
        finally:
            if not call.done():
                call.cancel()  # our deadline, the run's hard stop, or a stream we stopped reading


class SharedStreamsClient:
    """`--streams N`: every request on one of N long-lived ModelStreamInfer streams (spread over the
    channels), as tritonclient's `start_stream` + `async_stream_infer` send them, answers matched by id.
    `stream(req, chunks)` -> None once the request's final response (or its error) has come, else the
    error kind that ended its stream. A request abandoned at its deadline stays on the server (a stream
    has no per-request cancel); its later responses are dropped (`late` counts them)."""

    def __init__(self, spec: LLMLoadSpec, now: Callable[[], float]) -> None:
        self._model = spec.model
        self._seed = spec.seed
        self._temperature = spec.temperature
        self._metadata = (("x-priority", spec.priority),) if spec.priority is not None else ()
        self._now = now
        self._n = spec.streams
        self._pool = GrpcChannels(spec.url, min(spec.channels, spec.streams))
        self._calls: list[grpc.aio.StreamStreamCall] = []
        self._locks: list[asyncio.Lock] = []
        self._pending: list[dict[str, tuple[TextChunks, asyncio.Future[str | None]]]] = []
        self._readers: list[asyncio.Task[None]] = []
        self._next = itertools.cycle(range(self._n)).__next__
        self.late = 0

    async def start(self) -> None:
        await self._pool.connect(1.0)
        methods = [ch.stream_stream(STREAM_METHOD) for ch in self._pool.channels]
        for i in range(self._n):
            call = methods[i % len(methods)](metadata=self._metadata)
            self._calls.append(call)
            self._locks.append(asyncio.Lock())
            self._pending.append({})
            self._readers.append(asyncio.create_task(self._read(call, self._pending[i])))

    async def stream(self, req: PlannedRequest, chunks: TextChunks) -> str | None:
        rid = f"{self._seed}-{req.i}"
        i = self._next()
        pending = self._pending[i]
        outcome: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        pending[rid] = (chunks, outcome)
        try:
            async with self._locks[i]:  # one write at a time on a stream
                await self._calls[i].write(llm_request(self._model, rid, req, self._temperature))
            return await outcome
        except grpc.aio.AioRpcError as exc:  # the stream had already ended
            if is_connect_failure(exc):
                raise ConnectionError(exc.details()) from exc
            return error_kind(exc)
        finally:
            pending.pop(rid, None)

    async def _read(self, call: grpc.aio.StreamStreamCall, pending: dict) -> None:
        ended: str | None = "incomplete"
        try:
            while (raw := await call.read()) is not grpc.aio.EOF:
                msg = parse(raw)
                entry = None if msg is None else pending.get(msg.infer_response.id)
                if entry is None:
                    self.late += 1
                    continue
                chunks, outcome = entry
                feed_message(msg.infer_response.id, msg, self._now(), chunks)
                if (chunks.done_at is not None or chunks.error is not None) and not outcome.done():
                    outcome.set_result(None)
        except grpc.aio.AioRpcError as exc:
            ended = "connection" if is_connect_failure(exc) else error_kind(exc)
        finally:
            for _, outcome in pending.values():  # the stream ended under them
                if not outcome.done():
                    outcome.set_result(ended)

    async def close(self) -> None:
        for call in self._calls:
            call.cancel()
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        await self._pool.close()
