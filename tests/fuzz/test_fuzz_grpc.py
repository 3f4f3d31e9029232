"""Fuzzing the gRPC edge's ModelInferRequest decoder (grpc_edge/codec.py) and reading of a call: whatever
the message, decoding either succeeds or raises BadRequest naming the problem, which the edge answers
INVALID_ARGUMENT; it never crashes, hangs or allocates unbounded. The named cases of the issue: both
contents and raw_input_contents, a raw count that is not the inputs', a truncated BYTES length prefix, a
shape whose product is not the bytes sent, a shape of 10^12 elements refused before any allocation, a
deadline already past, and an oversized message refused by size before it is decoded."""

from __future__ import annotations

import math
import struct
import tracemalloc
from typing import Any

import grpc
import numpy as np
import pytest
from grpc import aio
from hypothesis import example, given
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.config import ModelConfig, ServerConfig, TensorSpec
from inferd.errors import BadRequest, DeadlineExceeded, ServingError
from inferd.grpc_edge.calls import RpcMetadata, grpc_call, read_hints
from inferd.grpc_edge.codec import decode_request
from inferd.grpc_edge.edge import server_options
from inferd.grpc_edge.errors import code_of
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.protos import grpc_service_pb2_grpc as pb_grpc
from inferd.models.sim import sim_config
from inferd.tensors import DATATYPES, NUMPY_DTYPES
from tests.fuzz.profiles import fuzz, time_limit

pytestmark = pytest.mark.timeout(time_limit(60))

Tensor = pb.ModelInferRequest.InferInputTensor


def _config(*inputs: TensorSpec) -> ModelConfig:
    return ModelConfig(
        name="m",
        implementation="x:Y",
        max_batch_size=8,
        inputs=inputs,
        outputs=(TensorSpec(name="O", datatype="FP32", shape=(-1,)),),
    )


CONFIGS = [
    sim_config(),
    _config(TensorSpec(name="A", datatype="INT32", shape=(2,)), TensorSpec(name="B", datatype="BYTES")),
    _config(TensorSpec(name="F", datatype="FP16", shape=(-1, 2))),
    _config(TensorSpec(name="X", datatype="FP32", shape=(-1,)), TensorSpec(name="Y", datatype="BOOL")),
    _config(TensorSpec(name="U", datatype="UINT8", shape=(3, -1))),
    _config(TensorSpec(name="I", datatype="INT8"), TensorSpec(name="D", datatype="FP64", shape=(1,))),
]
NAMES = ["INPUT0", "A", "B", "F", "X", "Y", "U", "I", "D", "nope", ""]


def decode(message: pb.ModelInferRequest, config: ModelConfig) -> Any:
    """Decode; a BadRequest (answered INVALID_ARGUMENT) is a fine answer, any other exception fails."""
    try:
        return decode_request(message, config)
    except BadRequest as exc:
        assert exc.message  # names the problem
        assert code_of(exc) == grpc.StatusCode.INVALID_ARGUMENT
        return None


def bytes_blob(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


# ---- structured messages ---------------------------------------------------------------------------------
shapes = st.lists(st.integers(min_value=-2, max_value=2**40), max_size=5) | st.lists(st.integers(0, 4), max_size=4)


def raw_for(shape: list[int], datatype: str) -> st.SearchStrategy[bytes]:
    """Raw bytes that fit `shape` roughly half the time, so decoding gets past the size checks."""
    count = math.prod(shape) if shape and all(0 <= d <= 8 for d in shape) else 3
    if datatype == "BYTES":
        fits = st.lists(st.binary(max_size=5), min_size=count, max_size=count).map(bytes_blob)
    elif datatype in NUMPY_DTYPES:
        fits = st.binary(min_size=count * NUMPY_DTYPES[datatype].itemsize, max_size=count * NUMPY_DTYPES[datatype].itemsize)
    else:
        fits = st.binary(max_size=16)
    return st.one_of(fits, st.binary(max_size=64))


def contents_for(shape: list[int]) -> st.SearchStrategy[pb.InferTensorContents]:
    count = math.prod(shape) if shape and all(0 <= d <= 8 for d in shape) else 3
    n = st.integers(max(0, count - 1), count + 1)
    return st.one_of(
        n.flatmap(lambda k: st.lists(st.booleans(), min_size=k, max_size=k)).map(lambda v: pb.InferTensorContents(bool_contents=v)),
        n.flatmap(lambda k: st.lists(st.integers(-(2**31), 2**31 - 1), min_size=k, max_size=k)).map(
            lambda v: pb.InferTensorContents(int_contents=v)
        ),
        n.flatmap(lambda k: st.lists(st.integers(0, 2**32 - 1), min_size=k, max_size=k)).map(
            lambda v: pb.InferTensorContents(uint_contents=v)
        ),
        n.flatmap(lambda k: st.lists(st.floats(width=32), min_size=k, max_size=k)).map(
            lambda v: pb.InferTensorContents(fp32_contents=v)
        ),
        n.flatmap(lambda k: st.lists(st.floats(), min_size=k, max_size=k)).map(lambda v: pb.InferTensorContents(fp64_contents=v)),
        n.flatmap(lambda k: st.lists(st.binary(max_size=4), min_size=k, max_size=k)).map(
            lambda v: pb.InferTensorContents(bytes_contents=v)
        ),
    )


parameters = st.dictionaries(
    st.sampled_from(["timeout", "priority", "binary_data_output", "x"]),
    st.one_of(
        st.booleans().map(lambda v: pb.InferParameter(bool_param=v)),
        st.integers(-(2**63), 2**63 - 1).map(lambda v: pb.InferParameter(int64_param=v)),
        st.text(max_size=6).map(lambda v: pb.InferParameter(string_param=v)),
        st.floats().map(lambda v: pb.InferParameter(double_param=v)),
        st.just(pb.InferParameter()),
    ),
    max_size=3,
)


@st.composite
def infer_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    n = draw(st.integers(0, 3))
    raw_mode = draw(st.sampled_from(["raw", "typed", "mixed"]))
    inputs, raws = [], []
    for _ in range(n):
        datatype = draw(st.sampled_from([*sorted(DATATYPES), "FP8", ""]))
        shape = draw(shapes)
        tensor = Tensor(name=draw(st.sampled_from(NAMES)), datatype=datatype, shape=shape)
        if raw_mode != "raw" and draw(st.booleans()):
            tensor.contents.CopyFrom(draw(contents_for(shape)))
        inputs.append(tensor)
        if raw_mode != "typed":
            raws.append(draw(raw_for(shape, datatype)))
    if raws and draw(st.integers(0, 5)) == 0:  # now and then one raw blob too many or too few
        raws = raws[:-1] if draw(st.booleans()) else [*raws, b""]
    outputs = [pb.ModelInferRequest.InferRequestedOutputTensor(name=o) for o in draw(st.lists(st.sampled_from(["O", "OUTPUT0", "Z"]), max_size=2))]
    return pb.ModelInferRequest(
        model_name="m",
        id=draw(st.text(max_size=5)),
        inputs=inputs,
        raw_input_contents=raws,
        outputs=outputs,
        parameters=draw(parameters),
    )


@fuzz()
@given(infer_requests(), st.sampled_from(CONFIGS))
def test_any_message_decodes_or_is_an_invalid_argument(message: pb.ModelInferRequest, config: ModelConfig) -> None:
    decoded = decode(message, config)
    if decoded is not None:  # a request that decodes holds one item per row, every input in each
        assert len(decoded.items) >= 1
        assert all(spec.name in {o.name for o in config.outputs} for spec, _ in decoded.outputs)


@fuzz(0.5)
@given(st.binary(max_size=512), st.sampled_from(CONFIGS))
@example(b"\x0a\x01m\x2a\x02\x0a\x00", CONFIGS[0])
def test_any_bytes_that_parse_decode_or_are_an_invalid_argument(data: bytes, config: ModelConfig) -> None:
    try:
        message = pb.ModelInferRequest.FromString(data)
    except Exception:  # grpc answers a message that does not parse before the edge sees it
        return
    decode(message, config)


# ---- the named cases -------------------------------------------------------------------------------------
def sim_input(n: int = 1) -> Tensor:
    return Tensor(name="INPUT0", datatype="BYTES", shape=[n])


def refused(message: pb.ModelInferRequest, config: ModelConfig | None = None) -> str:
    with pytest.raises(BadRequest) as err:
        decode_request(message, config or sim_config())
    assert code_of(err.value) == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.message


def test_both_contents_and_raw_input_contents_are_refused() -> None:
    tensor = sim_input()
    tensor.contents.bytes_contents.append(b"typed")
    message = refused(pb.ModelInferRequest(inputs=[tensor], raw_input_contents=[bytes_blob([b"raw"])]))
    assert "has contents while the request has raw_input_contents" in message


def test_a_raw_count_other_than_the_inputs_is_refused() -> None:
    blob = bytes_blob([b"x"])
    message = refused(pb.ModelInferRequest(inputs=[sim_input()], raw_input_contents=[blob, blob]))
    assert "raw_input_contents has 2 entries but the request has 1 inputs" in message


def test_a_truncated_bytes_length_prefix_is_refused() -> None:
    cut_prefix = bytes_blob([b"abc"]) + b"\x05\x00"  # a second element's length cut after two bytes
    assert "truncated BYTES element length at offset 7" in refused(
        pb.ModelInferRequest(inputs=[sim_input()], raw_input_contents=[cut_prefix])
    )
    too_long = struct.pack("<I", 9) + b"abc"  # a length past the blob's end
    assert "BYTES element of 9 bytes runs past" in refused(
        pb.ModelInferRequest(inputs=[sim_input()], raw_input_contents=[too_long])
    )


def test_a_shape_whose_product_is_not_the_bytes_sent_is_refused() -> None:
    config = _config(TensorSpec(name="X", datatype="FP32", shape=(4,)))
    tensor = Tensor(name="X", datatype="FP32", shape=[2, 4])
    message = refused(pb.ModelInferRequest(inputs=[tensor], raw_input_contents=[bytes(4 * 7)]), config)
    assert "holds 8 FP32 elements (32 bytes) but binary_data_size is 28" in message
    typed = Tensor(name="X", datatype="FP32", shape=[2, 4], contents=pb.InferTensorContents(fp32_contents=[1.0] * 7))
    assert "shape holds 8 elements but fp32_contents has 7" in refused(pb.ModelInferRequest(inputs=[typed]), config)


def test_a_shape_of_a_trillion_elements_is_refused_before_any_allocation() -> None:
    config = _config(TensorSpec(name="X", datatype="FP32", shape=(-1,)))
    tensor = Tensor(name="X", datatype="FP32", shape=[1, 10**12])
    tracemalloc.start()
    try:
        message = refused(pb.ModelInferRequest(inputs=[tensor], raw_input_contents=[b"\0" * 16]), config)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "holds 1000000000000 elements" in message
    assert peak < 1 << 20


def test_raw_numbers_are_viewed_in_place() -> None:
    config = _config(TensorSpec(name="X", datatype="FP32", shape=(2,)))
    data = np.arange(6, dtype=np.float32).reshape(3, 2)
    message = pb.ModelInferRequest(inputs=[Tensor(name="X", datatype="FP32", shape=[3, 2])], raw_input_contents=[data.tobytes()])
    items = decode_request(message, config).items
    assert [row.tolist() for row in items] == data.tolist()
    assert not items[0].flags.owndata  # a view of the message's bytes, not a copy


class Context:
    """The little of grpc.aio's ServicerContext that reading a call uses."""

    def __init__(self, remaining_s: float | None, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.remaining_s = remaining_s
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return self.remaining_s


@pytest.mark.parametrize("remaining_s", [0.0, -1.0])
def test_a_deadline_already_past_is_deadline_exceeded(remaining_s: float) -> None:
    context = Context(remaining_s)
    metadata = RpcMetadata(context.invocation_metadata())
    call = grpc_call(context, metadata, "/inference.GRPCInferenceService/ModelInfer", "sim", "", False)  # type: ignore[arg-type]
    with pytest.raises(DeadlineExceeded) as err:
        read_hints(call, metadata, context, FakeClock(), False)  # type: ignore[arg-type]
    assert code_of(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED


@fuzz(0.5)
@given(
    st.dictionaries(
        st.sampled_from(["x-priority", "x-request-timeout-ms", "x-tenant", "x-request-id", "authorization", "x-api-key", "other"]),
        st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12),
        max_size=4,
    ),
    st.one_of(st.none(), st.floats(-1, 100)),
    st.booleans(),
)
def test_any_metadata_reads_or_is_refused_with_a_status(headers: dict[str, str], remaining_s: float | None, keys: bool) -> None:
    context = Context(remaining_s, tuple(headers.items()))
    metadata = RpcMetadata(context.invocation_metadata())
    call = grpc_call(context, metadata, "/inference.GRPCInferenceService/ModelInfer", "sim", "", keys)  # type: ignore[arg-type]
    assert call.protocol == "grpc" and call.request_id
    try:
        read_hints(call, metadata, context, FakeClock(), keys)  # type: ignore[arg-type]
    except ServingError as exc:
        assert code_of(exc) in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED)


class Recording(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self) -> None:
        self.seen = 0

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        self.seen += 1
        return pb.ModelInferResponse(model_name=request.model_name)


async def test_an_oversized_message_is_refused_by_its_size_before_it_is_decoded() -> None:
    cfg = ServerConfig(grpc_max_message_bytes=64 * 1024)
    server = aio.server(options=server_options(cfg, reuseport=False))
    servicer = Recording()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            small = pb.ModelInferRequest(model_name="sim", raw_input_contents=[b"x" * 1024])
            assert (await stub.ModelInfer(small)).model_name == "sim"
            big = pb.ModelInferRequest(model_name="sim", raw_input_contents=[b"x" * (64 * 1024 + 1)])
            with pytest.raises(aio.AioRpcError) as err:
                await stub.ModelInfer(big)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert servicer.seen == 1
    finally:
        await server.stop(None)
