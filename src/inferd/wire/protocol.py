"""Wire messages between the front end and its workers. Length-prefixed MessagePack frames (msgspec).

One frame per batch, never per request. numpy arrays travel as MessagePack ext types
(dtype string, shape, raw bytes); errors travel as (code, message), never pickled.

Sequence: worker connects -> Hello -> front end answers Welcome (with the model config) -> worker loads
and warms up -> Ready -> RunBatch / BatchDone, Heartbeat every heartbeat_s -> Drain or Stop.

Credits (a worker shared by several front ends): when both Hello.credits and Welcome.credits are set,
the worker grants batch slots (Credit) and the front end sends a RunBatch only against one, reporting
what it has queued (Demand). Negotiated by those two fields, not by PROTOCOL_VERSION: a peer of an
older inferd leaves them False and the connection runs as before (the front end may hold two batches
on the worker); a worker joined to several front ends refuses such a front end (it could not keep its
cap).

Two families of messages live in their own modules and are part of `Message`: search shard replicas'
(wire/shards.py) and model pools' (wire/pools.py).
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from typing import Any

import msgspec
import numpy as np

from inferd.wire.pools import HeldModel as HeldModel
from inferd.wire.pools import LoadModel, LoadResult, PoolState, UnloadModel
from inferd.wire.pools import QueuedLoad as QueuedLoad
from inferd.wire.shards import ShardAssign, ShardCall, ShardReply

PROTOCOL_VERSION = 6
"""Bumped whenever a message changes shape in a way the other side cannot read; a worker of another
protocol is refused at Hello, with the reason. Fields added at the end with defaults are not a change
of shape: an older peer ignores them, a newer one reads the default (Credit.running_items, -1: "does
not say", and running_for_s; PoolState.queued, none). 2: Hello.version (versions side by side).
3: AddSequence.weight (tenants' shares of LLM admissions); search shard replicas (ShardAssign,
ShardCall, ShardReply; the other messages are unchanged). 4: StepDeltas.decoded_ids / decoded_tokens
(single tokens no longer travel as SeqDeltas). 5: ShardAssign carries the writer's epoch and the snapshot's
bytes, no longer a data_dir path. 6: model pools (Hello.pool, Welcome.pool_config_json, LoadModel,
UnloadModel, LoadResult, PoolState)."""
MAX_FRAME_BYTES = 512 * 1024 * 1024
MAX_HELLO_BYTES = 64 * 1024
"""Largest first frame (Hello) of a connection: a peer is not trusted with large frames before its token."""
_LEN = struct.Struct(">I")
_EXT_NDARRAY = 1
_EXT_OBJARRAY = 2


class Hello(msgspec.Struct, tag="hello"):
    worker_id: str
    model: str
    pid: int
    host: str
    token: str = ""
    protocol: int = PROTOCOL_VERSION
    version: int = 0
    """The model version this worker serves; 0: the model's default version."""
    credits: bool = False
    """The worker grants batch slots (Credit): its cap of 1 running + 1 staged batch holds across all
    the front ends it serves."""
    zone: str | None = None
    """The worker's zone (`inferd worker --zone`, a DNS label); None: none, or an older worker."""
    pool: str | None = None
    """The pool this worker belongs to (`inferd worker --pool NAME`). With `model` empty: the worker's
    pool link (LoadModel / UnloadModel in, LoadResult / PoolState / Heartbeat out, never a batch); with
    `model` set: one model the pool worker holds, served as any worker of that model is."""


class Welcome(msgspec.Struct, tag="welcome"):
    accepted: bool
    reason: str = ""
    model_config_json: bytes = b""
    heartbeat_s: float = 1.0
    silence_timeout_s: float = 0.0
    """How long the front end waits for a silent worker before giving it up (0: not said). A worker
    over TCP gives up on a connection whose data stays unacknowledged this long (TCP_USER_TIMEOUT):
    after a partition heals it then reconnects at once, instead of waiting out TCP's retransmission
    backoff (up to two minutes) on a connection the front end has already closed."""
    credits: bool = False
    """The front end sends batches only against the worker's Credit grants (when Hello.credits)."""
    pool_config_json: bytes = b""
    """A pool link's answer: the pool's settings (`[pools.NAME]`, PoolConfig as JSON: budget, limits)."""


class Ready(msgspec.Struct, tag="ready"):
    version: int
    load_s: float
    warmup_s: float


class LoadFailed(msgspec.Struct, tag="load_failed"):
    message: str


class RunBatch(msgspec.Struct, tag="run"):
    batch_id: int
    items: list[Any]
    traceparent: str = ""
    """W3C traceparent of the batch's inferd.batch span ("": not traced). Optional: a
    peer that predates it ignores it, and a frame without it decodes to ""."""


class BatchDone(msgspec.Struct, tag="done"):
    batch_id: int
    compute_s: float
    outputs: list[Any] = []
    """One entry per item: the item's outputs in wire form, or None where item_errors has an entry."""
    item_errors: dict[int, tuple[str, str]] = {}
    batch_error: tuple[str, str] | None = None
    """(code, message) when the whole batch failed."""


class Heartbeat(msgspec.Struct, tag="hb"):
    running: int
    completed_batches: int
    high_water: int = 0
    """The most batches the worker has held at once (running + staged, from all its front ends)."""


class Drain(msgspec.Struct, tag="drain"):
    """Front end -> worker: finish what you hold, then exit. Worker -> front end (it drains: SIGTERM, or
    another front end's Drain): send me no new work, and answer Drain after the last you sent. The
    worker's device stops once every front end has sent one (worker/main.py `_drain`)."""

    retired: bool = False
    """Front end -> worker: the version it serves is no longer served (a rolling update's old one). A
    worker that serves the model's default version (no --model-version) then joins again, at the default
    version the front ends serve now, instead of exiting (worker/main.py `main`)."""


# ---- LLM engine (models with platform "inferd_llm"): one AddSequence per request, one StepDeltas per step


class AddSequence(msgspec.Struct, tag="llm_add"):
    seq_id: str
    prompt: list[int]
    max_tokens: int
    seed: int | None = None
    priority: int = 0
    tenant: str = ""
    temperature: float = 1.0
    """0 samples greedily (argmax)."""
    top_p: float = 1.0
    ignore_eos: bool = False
    """Generate max_tokens even past the model's end-of-turn token (benchmarks; vLLM's extension)."""
    output: list[int] = []
    """Tokens already generated for this sequence on a worker that died: the engine resumes after them
    (recomputing prompt + output), and max_tokens counts them."""
    weight: float = 1.0
    """The tenant's weight: its share of the engine's admissions while other tenants' sequences wait."""
    traceparent: str = ""
    """W3C traceparent of the request's span ("": not traced); optional, as in RunBatch."""


class AbortSequence(msgspec.Struct, tag="llm_abort"):
    """The client went away: end the sequence and free its KV blocks."""

    seq_id: str


class SeqDelta(msgspec.Struct):
    seq_id: str
    token_ids: list[int] = []
    finish_reason: str | None = None
    """"stop", "length", "abort" or "error"; None while the sequence runs on."""
    error: tuple[str, str] | None = None
    """(code, message) when the engine refused or failed the sequence."""


class LLMStats(msgspec.Struct):
    """The engine's scheduler statistics after a step (SchedulerStatistics, on the wire)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    preemptions: int = 0
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    errored: int = 0
    prefix_hit_tokens: int = 0
    """Prompt tokens found in the prefix cache at admission, since the engine started."""
    prefix_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache at admission, since the engine started."""


class StepDeltas(msgspec.Struct, tag="llm_step"):
    """Every sequence's new tokens after one engine step (or refusals and aborts between steps)."""

    compute_s: float
    deltas: list[SeqDelta]
    stats: LLMStats
    admitted: list[str] = []
    """Sequences the step admitted (left the waiting queue): the front end's admission counts them off."""
    preempted: list[str] = []
    """Sequences the step preempted (their KV blocks freed; recomputed when readmitted): the front end
    marks it on their traces. Optional: a peer that predates it sends none."""
    decoded_ids: list[str] = []
    decoded_tokens: list[int] = []
    """The common case, side by side: sequence `decoded_ids[i]` got the one token `decoded_tokens[i]`
    and goes on. No SeqDelta per token: two flat lists encode, decode and stream at a fraction of the
    cost. `deltas` carries the rest (ends, errors, refusals)."""

    def all_deltas(self) -> list[SeqDelta]:
        """Every sequence's delta, the single tokens as SeqDeltas too (for inspection, not the hot path)."""
        one = zip(self.decoded_ids, self.decoded_tokens, strict=True)
        return [*(SeqDelta(i, [t]) for i, t in one), *self.deltas]


# ---- Credits: a worker's batch slots, granted to the front ends it serves (Hello/Welcome.credits)


class Credit(msgspec.Struct, tag="credit"):
    """Worker -> front end: `granted` more batches the front end may send now (each one of the worker's
    slots: 1 running + 1 staged, across all its front ends); 0 only updates the state below."""

    granted: int
    idle: bool
    """Nothing runs on the worker now: a batch sent runs at once (else it is staged)."""
    shared: bool
    """Other front ends use the worker too: slots are granted on Demand, and a front end gives back
    those it cannot use at once (a worker serving one front end grants it every free slot)."""
    running_items: int = -1
    """Items of the batch running on the worker now, whichever front end's (0: none runs; -1: a worker
    that does not say): a front end holding a slot times its staging from it."""
    running_for_s: float = 0.0
    """How long that batch has run (0 when none runs: a front end told "busy" then waits for another
    front end's batch, which starts about now)."""


class Demand(msgspec.Struct, tag="demand"):
    """Front end -> worker: what it has queued for the model (the worker grants free slots to the
    front end whose oldest item has waited longest), and slots it gives back unused."""

    queued: int
    oldest_age_s: float = 0.0
    returned: int = 0


Message = (
    Hello
    | Welcome
    | Ready
    | LoadFailed
    | RunBatch
    | BatchDone
    | Heartbeat
    | Drain
    | AddSequence
    | AbortSequence
    | StepDeltas
    | ShardAssign
    | ShardCall
    | ShardReply
    | Credit
    | Demand
    | LoadModel
    | UnloadModel
    | LoadResult
    | PoolState
)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            flat = [x if isinstance(x, bytes) else str(x).encode() for x in obj.ravel().tolist()]
            return msgspec.msgpack.Ext(_EXT_OBJARRAY, msgspec.msgpack.encode((list(obj.shape), flat)))
        arr = np.ascontiguousarray(obj)
        header = msgspec.msgpack.encode((arr.dtype.str, list(arr.shape)))
        return msgspec.msgpack.Ext(_EXT_NDARRAY, _LEN.pack(len(header)) + header + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to or from a worker")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_NDARRAY:
        (hlen,) = _LEN.unpack_from(data, 0)
        dtype, shape = msgspec.msgpack.decode(data[4 : 4 + hlen], type=tuple[str, list[int]])
        return np.frombuffer(data[4 + hlen :], dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == _EXT_OBJARRAY:
        shape, flat = msgspec.msgpack.decode(data)
        arr = np.empty(len(flat), dtype=object)
        arr[:] = flat
        return arr.reshape(shape)
    raise ValueError(f"unknown ext type {code} in a worker frame")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(Message, ext_hook=_ext_hook)


def encode_frame(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


class ConnectionClosed(Exception):
    pass


class ProtocolError(ConnectionClosed):
    """A frame that is no message of this protocol: the connection is dropped."""


_MALFORMED = (msgspec.DecodeError, ValueError, TypeError, struct.error, RecursionError)
"""What decoding a malformed frame raises (an array ext's header or bytes that do not fit included)."""


def decode_message(body: bytes) -> Message:
    """One frame's message; ProtocolError (naming the problem) if the bytes are not one."""
    try:
        return _decoder.decode(body)
    except _MALFORMED as exc:
        raise ProtocolError(f"malformed worker frame of {len(body)} bytes: {exc}") from None


async def read_message(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """The next message; ConnectionClosed when the peer is gone or sent a frame over `max_bytes` or one that
    does not decode (ProtocolError)."""
    try:
        (size,) = _LEN.unpack(await reader.readexactly(4))
        if size > max_bytes:
            raise ProtocolError(f"frame of {size} bytes exceeds the {max_bytes} byte limit")
        body = await reader.readexactly(size)
    except (asyncio.IncompleteReadError, OSError) as exc:  # OSError: reset, or timed out (TCP_USER_TIMEOUT)
        raise ConnectionClosed(str(exc) or "connection closed") from None
    return decode_message(body)


def parse_address(address: str) -> tuple[str, str | tuple[str, int]]:
    """'unix:/path' or 'HOST:PORT' -> ('unix', path) or ('tcp', (host, port))."""
    if address.startswith("unix:"):
        return "unix", address[5:]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is neither 'unix:/path' nor 'HOST:PORT'")
    return "tcp", (host.strip("[]") or "127.0.0.1", int(port))


async def open_connection(
    address: str, tls: ssl.SSLContext | None = None, server_hostname: str | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A Unix socket, or TCP (over TLS with `tls`, the server's certificate checked against
    `server_hostname`: by default the address's host)."""
    kind, target = parse_address(address)
    if kind == "unix":
        assert isinstance(target, str)
        return await asyncio.open_unix_connection(target, limit=2**20)
    assert isinstance(target, tuple)
    named = {"server_hostname": server_hostname} if tls is not None and server_hostname else {}
    return await asyncio.open_connection(target[0], target[1], limit=2**20, ssl=tls, **named)
