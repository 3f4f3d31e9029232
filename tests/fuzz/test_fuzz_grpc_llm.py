"""Fuzzing the gRPC edge's reading of an LLM request (grpc_edge/llm.py): Triton's vLLM tensors with any
names, datatypes, shapes and contents, raw or typed, and any sampling_parameters. Whatever the message,
the answer is a checked request or BadRequest naming the problem: never another exception, never an
allocation sized by the shape."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from inferd.api.binary import encode_bytes_elements
from inferd.errors import BadRequest
from inferd.grpc_edge import llm
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from tests.fuzz.profiles import fuzz, time_limit

pytestmark = pytest.mark.timeout(time_limit(60))

leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)
anything = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)
KEYS = [*llm.HONORED, "top_k", "presence_penalty", "logprobs", "temprature", ""]
sampling = st.dictionaries(st.sampled_from(KEYS), anything, max_size=6)

NAMES = [*llm.INPUTS, "INPUT0", "text"]
DATATYPES = ["BYTES", "BOOL", "INT32", "FP32", ""]
shapes = st.lists(st.sampled_from([0, 1, 1, 1, 2, -1, 10**12, 2**63 - 1]), max_size=3)


@st.composite
def tensor(draw: st.DrawFn) -> tuple[str, str, list[int], bytes | bool | None]:
    """(name, datatype, shape, value): a value of the tensor's kind, raw bytes of any length, or none."""
    name = draw(st.sampled_from(NAMES))
    value: bytes | bool | None = draw(
        st.one_of(
            st.none(),
            st.booleans(),
            st.binary(max_size=12),
            st.builds(lambda s: json.dumps(s).encode(), sampling),
            st.text(max_size=8).map(str.encode),
        )
    )
    return name, draw(st.sampled_from(DATATYPES)), draw(shapes), value


def build(tensors: list[tuple[str, str, list[int], Any]], raw: bool, framed: bool) -> pb.ModelInferRequest:
    """A request with the tensors in raw_input_contents (length-prefixed BYTES when `framed`) or in
    typed contents."""
    req = pb.ModelInferRequest(model_name="sim-llm", id="f")
    for name, datatype, shape, value in tensors:
        inp = req.inputs.add(name=name, datatype=datatype, shape=shape)
        if raw:
            if isinstance(value, bool):
                req.raw_input_contents.append(bytes([value]))
            else:
                data = value or b""
                req.raw_input_contents.append(encode_bytes_elements([data]) if framed else data)
        elif isinstance(value, bool):
            inp.contents.bool_contents.append(value)
        elif value is not None:
            inp.contents.bytes_contents.append(value)
    return req


def read(req: pb.ModelInferRequest) -> llm.TextRequest | None:
    try:
        text = llm.read_text_request(req)
    except BadRequest as exc:
        assert exc.message
        return None
    text.generation.checked()  # a request read is a checked one
    return text


@fuzz()
@given(st.lists(tensor(), max_size=5), st.booleans(), st.booleans())
@example([("text_input", "BYTES", [10**12], b"x")], True, True)
@example([("text_input", "BYTES", [1], b"\xff\xfe")], True, True)
@example([("text_input", "BYTES", [1], b"\x05\x00\x00")], True, False)
def test_any_tensors_read_or_raise_bad_request(tensors: list[Any], raw: bool, framed: bool) -> None:
    read(build(tensors, raw, framed))


@fuzz()
@given(st.one_of(sampling, anything))
@example({"seed": 2**64})
@example({"max_tokens": 2**70, "n": "16"})
@example({"temperature": "1e999"})
def test_any_sampling_parameters_read_or_raise_bad_request(params: Any) -> None:
    req = build([("text_input", "BYTES", [1], b"p"), ("sampling_parameters", "BYTES", [1], b"")], True, True)
    req.raw_input_contents[1] = encode_bytes_elements([json.dumps(params).encode()])
    read(req)


@fuzz(0.25)
@given(st.binary(max_size=64))
@example(b"[" * 100_000)
@example(b'{"stop": "\\ud800"}')
def test_any_sampling_bytes_read_or_raise_bad_request(data: bytes) -> None:
    req = build([("text_input", "BYTES", [1], b"p"), ("sampling_parameters", "BYTES", [1], data)], True, True)
    read(req)


def test_an_llm_request_without_text_input_names_it() -> None:
    req = build([("stream", "BOOL", [1], True), ("sampling_parameters", "BYTES", [1], b"{}")], True, True)
    with pytest.raises(BadRequest, match="input 'text_input' is missing"):
        llm.read_text_request(req)


def test_bad_sampling_parameters_json_names_it() -> None:
    req = build([("text_input", "BYTES", [1], b"p"), ("sampling_parameters", "BYTES", [1], b"{oops")], True, True)
    with pytest.raises(BadRequest, match="input 'sampling_parameters': malformed JSON"):
        llm.read_text_request(req)
