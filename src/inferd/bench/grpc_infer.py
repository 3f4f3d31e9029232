"""`inferd bench --protocol grpc`: each request as Triton's `ModelInfer` over grpc.aio, and the reading of
its answer for the same check as REST's.

A request is one BYTES input, INPUT0 of shape [1], sent in `raw_input_contents` as tritonclient sends it
(a 4-byte little-endian length, then the payload). Its bytes are built as the HTTP mode builds its JSON
body: the part every request shares (model name, the input's declaration) serialized once, then the
request's own id and payload appended as two length-delimited protobuf fields (a message's fields may
come in any order). Answers are read from `raw_output_contents` (Triton's way) or typed `contents`.

Requests take several channels in turn, each with its own HTTP/2 connection (a local subchannel pool, so
grpc does not fold them into one), as the HTTP clients spread requests over connections. A request
cancelled by its deadline cancels its RPC (the server sees the stream reset, as it sees an HTTP
disconnect). A status other than OK is the error kind `grpc_<code>` (`grpc_resource_exhausted`, ...); a
channel that cannot connect is a connection error, as a refused HTTP connection is.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Iterable

import grpc

from inferd.bench.infer_requests import Answer, BadAnswer, Fields
from inferd.bench.load_spec import LoadSpec
from inferd.grpc_edge.protos import grpc_service_pb2 as pb

INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
_ID_TAG = b"\x1a"  # ModelInferRequest.id: field 3, length-delimited
_RAW_TAG = b"\x3a"  # ModelInferRequest.raw_input_contents: field 7, length-delimited

# Response metadata the engine reads, by name, mapped to the spelling `Recorder` looks up (gRPC metadata
# names are lower case).
WANTED_METADATA = {
    name.lower(): name
    for name in ("X-Inferd-Queue-Ms", "X-Inferd-Compute-Ms", "X-Inferd-Batch-Size", "X-Inferd-Attempts")
} | {"retry-after": "Retry-After"}


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def bytes_element(data: bytes) -> bytes:
    """One BYTES tensor element as raw contents carry it: a 4-byte little-endian length, then the bytes."""
    return len(data).to_bytes(4, "little") + data


def request_head(model: str) -> bytes:
    """What every request of a run shares: the model and the declaration of INPUT0 (BYTES, shape [1])."""
    tensor = pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="BYTES", shape=[1])
    return pb.ModelInferRequest(model_name=model, inputs=[tensor]).SerializeToString()


def infer_request(head: bytes, rid: str, payload: str) -> bytes:
    """The serialized ModelInferRequest: `head`, then this request's id and raw INPUT0."""
    rid_b = rid.encode()
    raw = bytes_element(payload.encode())
    return b"".join((head, _ID_TAG, varint(len(rid_b)), rid_b, _RAW_TAG, varint(len(raw)), raw))


def first_bytes_element(blob: bytes) -> bytes:
    """The first element of a raw BYTES tensor (`BadAnswer` when its length prefix runs past the blob)."""
    if len(blob) < 4:
        raise BadAnswer("raw BYTES output shorter than its length prefix")
    n = int.from_bytes(blob[:4], "little")
    if 4 + n > len(blob):
        raise BadAnswer("raw BYTES output shorter than its element")
    return blob[4 : 4 + n]


def grpc_fields(raw: bytes) -> Fields:
    """The checked fields of a serialized ModelInferResponse: OUTPUT0's digest from raw_output_contents,
    else from typed contents."""
    try:
        resp = pb.ModelInferResponse.FromString(raw)
    except Exception as exc:  # protobuf's DecodeError; upb raises its own
        raise BadAnswer(f"not a ModelInferResponse: {exc}") from exc
    if resp.raw_output_contents:
        element = first_bytes_element(resp.raw_output_contents[0])
    elif resp.outputs and resp.outputs[0].contents.bytes_contents:
        element = resp.outputs[0].contents.bytes_contents[0]
    else:
        raise BadAnswer("no OUTPUT0 contents")
    try:
        digest = element.decode()
    except UnicodeDecodeError as exc:
        raise BadAnswer("OUTPUT0 is not text") from exc
    return resp.id, resp.model_name, resp.model_version, digest


def error_kind(exc: grpc.aio.AioRpcError) -> str:
    """`grpc_<code>` for a status the server (or the client's own deadline) gave."""
    return f"grpc_{exc.code().name.lower()}"


def is_connect_failure(exc: grpc.aio.AioRpcError) -> bool:
    """UNAVAILABLE because no connection could be made, not because the server said so."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    text = f"{exc.details() or ''} {exc.debug_error_string() or ''}".lower()
    return "failed to connect" in text or "connection refused" in text or "connect failed" in text


def wanted(*metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """The response metadata `Recorder` reads, under its spelling."""
    out: dict[str, str] = {}
    for md in metadata:
        for key, value in md or ():
            name = WANTED_METADATA.get(key)
            if name is not None and isinstance(value, str):
                out[name] = value
    return out


def request_metadata(spec: LoadSpec) -> tuple[tuple[str, str], ...]:
    """X-Priority and the extra headers as metadata (names lower-cased, as gRPC requires)."""
    extra = [("x-priority", spec.priority)] if spec.priority is not None else []
    return tuple(extra + [(name.lower(), value) for name, value in spec.headers])


def channel_options(max_message_bytes: int = 64 << 20) -> list[tuple[str, int]]:
    """Each channel its own connection, and room for large answers."""
    return [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


class GrpcChannels:
    """`n` insecure grpc.aio channels to one target, opened together and taken in turn."""

    def __init__(self, target: str, n: int) -> None:
        self.target = target
        self.channels = [grpc.aio.insecure_channel(target, options=channel_options()) for _ in range(n)]

    async def connect(self, wait_s: float) -> None:
        """Wait up to `wait_s` for the channels to connect; one that cannot shows up per request."""
        waits = [asyncio.ensure_future(ch.channel_ready()) for ch in self.channels]
        _, pending = await asyncio.wait(waits, timeout=wait_s)
        for w in pending:
            w.cancel()
        for w in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await w

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close(grace=None)


class GrpcInferClient:
    """Sends `inferd bench`'s requests as ModelInfer calls: `send(rid, payload, deadline) -> Answer`."""

    def __init__(self, spec: LoadSpec, now: Callable[[], float]) -> None:
        self._head = request_head(spec.model)
        self._metadata = request_metadata(spec)
        self._send_deadline = spec.send_deadline
        self._connect_wait_s = min(1.0, spec.timeout_ms / 1000.0)
        self._now = now
        self._pool = GrpcChannels(spec.url, spec.channels)
        calls = [ch.unary_unary(INFER_METHOD) for ch in self._pool.channels]  # bytes in, bytes out
        self._next = itertools.cycle(calls).__next__

    fields = staticmethod(grpc_fields)

    async def start(self) -> None:
        await self._pool.connect(self._connect_wait_s)

    async def send(self, rid: str, payload: str, deadline: float) -> Answer:
        timeout = max(0.001, deadline - self._now()) if self._send_deadline else None
        call = self._next()(infer_request(self._head, rid, payload), metadata=self._metadata, timeout=timeout)
        try:
            raw = await call
        except grpc.aio.AioRpcError as exc:
            if is_connect_failure(exc):
                raise ConnectionError(exc.details()) from exc
            return error_kind(exc), wanted(exc.trailing_metadata()), b""
        return None, wanted(await call.trailing_metadata()), raw  # the edge sends its record as trailers

    async def close(self) -> None:
        await self._pool.close()
