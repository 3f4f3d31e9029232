"""Worker frames and model-output checking."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from inferd.config import ModelConfig, TensorSpec
from inferd.wire import protocol as p
from inferd.worker.main import give_up_when_silent
from inferd.worker.outputs import OutputError, convert_outputs


async def test_frames_roundtrip_arrays_bytes_and_errors() -> None:
    reader = asyncio.StreamReader()
    batch = p.RunBatch(
        7,
        [
            b"x",
            np.arange(6, dtype=np.float32).reshape(2, 3),
            {"a": np.array([b"u", b"v"], dtype=object), "b": 3},
        ],
    )
    done = p.BatchDone(7, 0.01, outputs=[None], item_errors={0: ("ModelError", "bad")})
    reader.feed_data(p.encode_frame(batch) + p.encode_frame(done))
    reader.feed_eof()
    got = await p.read_message(reader)
    assert isinstance(got, p.RunBatch) and got.batch_id == 7
    assert got.items[0] == b"x"
    np.testing.assert_array_equal(got.items[1], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert got.items[2]["a"].tolist() == [b"u", b"v"] and got.items[2]["b"] == 3
    got2 = await p.read_message(reader)
    assert got2.item_errors == {0: ("ModelError", "bad")}
    with pytest.raises(p.ConnectionClosed):
        await p.read_message(reader)


def test_address_parsing() -> None:
    assert p.parse_address("unix:/tmp/x.sock") == ("unix", "/tmp/x.sock")
    assert p.parse_address("10.0.0.1:9000") == ("tcp", ("10.0.0.1", 9000))
    with pytest.raises(ValueError, match="neither"):
        p.parse_address("nowhere")


def cfg() -> ModelConfig:
    return ModelConfig(
        name="m",
        implementation="x:Y",
        inputs=(TensorSpec(name="I", datatype="FP32"),),
        outputs=(TensorSpec(name="V", datatype="FP32", shape=(2,)), TensorSpec(name="N", datatype="INT32")),
    )


def test_outputs_are_typed_and_checked_per_item() -> None:
    out, errors = convert_outputs(cfg(), [{"V": [1, 2], "N": 3}, {"V": [1, 2, 3], "N": 1}, {"V": [0, 0]}], 3)
    assert out[0]["V"].dtype == np.float32 and out[0]["N"] == 3
    assert "shape [3]" in errors[1] and "missing" in errors[2]


def test_one_bytes_scalar_per_item_converts_as_before_whatever_its_form() -> None:
    """str and bytes take the short way; every other form (numpy, a dict naming the output, a str
    that is no valid Unicode, a number) the general one, with the same results and messages."""
    config = ModelConfig(
        name="t",
        implementation="x:Y",
        inputs=(TensorSpec(name="I", datatype="BYTES", shape=()),),
        outputs=(TensorSpec(name="O", datatype="BYTES", shape=()),),
    )
    outs = ["abc", b"raw", np.array([b"np"], dtype=object), {"O": "named"}, np.bytes_(b"g"), "\ud800", 7]
    out, errors = convert_outputs(config, outs, len(outs))
    assert out[:5] == [{"O": b"abc"}, {"O": b"raw"}, {"O": b"np"}, {"O": b"named"}, {"O": b"g"}]
    assert out[5] is None and "item 5 is invalid" in errors[5] and "surrogate" in errors[5]
    assert out[6] is None and "O is BYTES, got int" in errors[6]
    assert sorted(errors) == [5, 6]


def test_wrong_output_count_fails_the_batch() -> None:
    with pytest.raises(OutputError, match="returned 1 outputs for a batch of 2 inputs"):
        convert_outputs(cfg(), [{"V": [1, 2], "N": 3}], 2)
    with pytest.raises(OutputError, match="expected a list"):
        convert_outputs(cfg(), None, 2)


async def test_a_worker_over_tcp_gives_up_when_unacknowledged_for_the_front_ends_silence_timeout() -> None:
    """The front end says its heartbeat timeout in Welcome; the worker's TCP connection then ends itself
    when what it sends stays unacknowledged that long (TCP_USER_TIMEOUT), so a partitioned worker learns
    it was given up and rejoins once the network heals. Unix sockets and an unsaid timeout are left be."""
    assert p.decode_message(p.encode_frame(p.Welcome(accepted=True, silence_timeout_s=2.5))[4:]) == p.Welcome(
        accepted=True, silence_timeout_s=2.5
    )
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    sock = writer.get_extra_info("socket")
    try:
        give_up_when_silent(writer, 0.0)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0
        give_up_when_silent(writer, 2.5)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2500
    finally:
        writer.close()
        server.close()
        await server.wait_closed()
