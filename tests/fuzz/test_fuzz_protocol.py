"""Fuzzing the worker wire protocol decoder: any bytes on a worker connection either decode to a message or
raise ConnectionClosed (the connection is dropped, the hub and the worker stay up); never another error."""

from __future__ import annotations

import asyncio
import struct

import msgspec
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from inferd.wire import protocol as p
from tests.fuzz.profiles import fuzz, time_limit

pytestmark = pytest.mark.timeout(time_limit(60))


def read_all(data: bytes) -> list[p.Message]:
    """Every message of `data`, until the connection is closed (ConnectionClosed)."""

    async def run() -> list[p.Message]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        out: list[p.Message] = []
        while True:
            try:
                out.append(await p.read_message(reader))
            except p.ConnectionClosed:
                return out

    return asyncio.run(run())


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def ndarray_ext(dtype: object, shape: object, raw: bytes) -> msgspec.msgpack.Ext:
    header = msgspec.msgpack.encode((dtype, shape))
    return msgspec.msgpack.Ext(1, struct.pack(">I", len(header)) + header + raw)


dtypes = st.sampled_from(["<f4", "|u1", "<i8", "|O", "|V0", "<U2", "S3", "(2,)f4", "?", "nope", "", "<M8[s]"])
shapes = st.one_of(
    st.lists(st.integers(-3, 2**40), max_size=3), st.text(max_size=3), st.integers(-(2**63), 2**63 - 1)
)
exts = st.one_of(
    st.builds(
        ndarray_ext, st.one_of(dtypes, st.integers(-(2**63), 2**63 - 1)), shapes, st.binary(max_size=24)
    ),
    st.builds(lambda c, d: msgspec.msgpack.Ext(c, d), st.integers(-128, 127), st.binary(max_size=24)),
    st.builds(
        lambda shape, flat: msgspec.msgpack.Ext(2, msgspec.msgpack.encode((shape, flat))),
        shapes,
        st.one_of(st.lists(st.binary(max_size=3), max_size=4), st.integers(0, 9)),
    ),
)
items = st.lists(st.one_of(st.binary(max_size=8), st.integers(-(2**63), 2**63 - 1), exts), max_size=4)


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """A MessagePack map shaped like a message, with a real or wrong tag and fields of any type."""
    tag = draw(
        st.sampled_from(
            ["hello", "welcome", "ready", "run", "done", "hb", "drain", "llm_add", "llm_step", "x"]
        )
    )
    fields = draw(
        st.dictionaries(
            st.sampled_from(
                ["worker_id", "batch_id", "items", "outputs", "deltas", "stats", "prompt", "seq_id"]
            ),
            st.one_of(items, st.integers(-(2**63), 2**63 - 1), st.text(max_size=4), st.none()),
            max_size=4,
        )
    )
    return msgspec.msgpack.encode({"type": tag, **fields})


@fuzz()
@given(st.binary(max_size=600))
@example(b"\x00\x00\x00\x00")
@example(b"\xff\xff\xff\xff")
@example(frame(b"\xc1"))
def test_raw_bytes_only_close_the_connection(data: bytes) -> None:
    read_all(data)


@fuzz()
@given(st.lists(st.one_of(messages(), st.binary(max_size=40)), max_size=3))
def test_malformed_frames_only_close_the_connection(bodies: list[bytes]) -> None:
    read_all(b"".join(frame(b) for b in bodies))


@fuzz()
@given(st.lists(exts, min_size=1, max_size=3))
@example([ndarray_ext("|O", [1], b"\x00" * 8)])
@example([ndarray_ext("<f4", [3], b"\x00" * 4)])
@example([msgspec.msgpack.Ext(1, b"\x00")])
def test_broken_array_payloads_only_close_the_connection(payload: list[msgspec.msgpack.Ext]) -> None:
    body = msgspec.msgpack.encode({"type": "run", "batch_id": 1, "items": payload})
    got = read_all(frame(body))
    for msg in got:
        assert isinstance(msg, p.RunBatch)


@fuzz(0.5)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=8),
            st.builds(
                lambda dt, n: np.arange(n, dtype=dt),
                st.sampled_from(["<f4", "<i8", "|u1", "<f2"]),
                st.integers(0, 6),
            ),
            st.lists(st.binary(max_size=4), max_size=3).map(lambda v: np.array(v, dtype=object)),
        ),
        max_size=4,
    )
)
def test_valid_batches_round_trip(values: list[object]) -> None:
    (got,) = read_all(p.encode_frame(p.RunBatch(3, values)))
    assert isinstance(got, p.RunBatch)
    for sent, back in zip(values, got.items, strict=True):
        if isinstance(sent, np.ndarray):
            assert isinstance(back, np.ndarray) and back.dtype == sent.dtype
            np.testing.assert_array_equal(back, sent)
        else:
            assert back == sent


def test_undecodable_frames_raise_protocol_error_naming_the_frame() -> None:
    """Bytes that are no message (bad MessagePack, a missing field, an array ext whose bytes do not fit its
    shape or whose dtype is object) once escaped as msgspec/numpy errors, past the worker's read loop."""
    bodies = [
        b"\xc1",
        msgspec.msgpack.encode({"type": "hello"}),
        msgspec.msgpack.encode(
            {"type": "run", "batch_id": 1, "items": [ndarray_ext("<f4", [3], b"\x00" * 4)]}
        ),
        msgspec.msgpack.encode(
            {"type": "run", "batch_id": 1, "items": [ndarray_ext("|O", [1], b"\x00" * 8)]}
        ),
        msgspec.msgpack.encode({"type": "run", "batch_id": 1, "items": [msgspec.msgpack.Ext(1, b"\x00")]}),
    ]
    for body in bodies:
        with pytest.raises(p.ProtocolError, match="malformed worker frame"):
            p.decode_message(body)


async def test_a_frame_over_the_limit_is_refused_before_its_body_is_read() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack(">I", p.MAX_HELLO_BYTES + 1))  # the body never comes
    with pytest.raises(p.ProtocolError, match="exceeds"):
        await p.read_message(reader, p.MAX_HELLO_BYTES)
