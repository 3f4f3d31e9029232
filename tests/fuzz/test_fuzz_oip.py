"""Fuzzing the OIP request decoder (JSON and Triton's binary tensor extension): whatever the body, decoding
either succeeds or raises BadRequest naming the problem; it never crashes, hangs or allocates unbounded."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from inferd.api import binary, oip
from inferd.config import ModelConfig, TensorSpec
from inferd.errors import BadRequest
from inferd.models.sim import sim_config
from inferd.tensors import DATATYPES, NUMPY_DTYPES
from tests.fuzz.profiles import fuzz, time_limit

pytestmark = pytest.mark.timeout(time_limit(60))


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
    _config(TensorSpec(name="I", datatype="INT64"), TensorSpec(name="D", datatype="FP64", shape=(1,))),
]

NAMES = ["INPUT0", "A", "B", "F", "X", "Y", "U", "I", "D", "nope", ""]


def decode(body: bytes, header_length: str | None, config: ModelConfig) -> oip.DecodedRequest | None:
    """Decode; a BadRequest is a fine answer, any other exception fails the test."""
    try:
        return oip.decode_request(body, header_length, config)
    except BadRequest as exc:
        assert exc.message  # names the problem
        return None


# ---- raw bytes ---------------------------------------------------------------------------------------------
@fuzz()
@given(st.binary(max_size=2048), st.sampled_from(CONFIGS))
@example(b"", CONFIGS[0])
@example(b"[" * 10_000, CONFIGS[0])
@example(b'{"inputs":[' + b"[" * 5000, CONFIGS[1])
def test_raw_bytes_only_raise_bad_request(body: bytes, config: ModelConfig) -> None:
    decode(body, None, config)


@fuzz()
@given(
    st.binary(max_size=1024),
    st.one_of(st.none(), st.integers(-5, 1100).map(str), st.text(max_size=8)),
    st.sampled_from(CONFIGS),
)
@example(b"{}", "+2", CONFIGS[0])
@example(b"{}", "1_0", CONFIGS[0])
@example(b"{}", "\u0662", CONFIGS[0])
def test_raw_bytes_with_binary_header_only_raise_bad_request(
    body: bytes, header_length: str | None, config: ModelConfig
) -> None:
    decode(body, header_length, config)


# ---- structured JSON ---------------------------------------------------------------------------------------
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=30,
)
shapes = st.lists(st.integers(min_value=-2, max_value=2**40), max_size=5) | st.lists(
    st.integers(0, 4), max_size=4
)
params = st.dictionaries(
    st.sampled_from(["binary_data_size", "timeout", "priority", "binary_data_output", "binary_data", "x"]),
    json_scalars,
    max_size=3,
)


def data_for(shape: list[int], datatype: str) -> st.SearchStrategy[object]:
    """Data that fits `shape` roughly half the time, so decoding gets past the shape checks."""
    count = math.prod(shape) if shape and all(0 <= d <= 8 for d in shape) else 3
    element = {
        "BYTES": st.text(max_size=5),
        "BOOL": st.booleans(),
        "FP16": st.floats(width=16),
        "FP32": st.floats(width=32, allow_nan=True),
        "FP64": st.floats(),
    }.get(datatype, st.integers(-(2**65), 2**65))
    return st.one_of(st.lists(element, min_size=count, max_size=count), json_values)


@st.composite
def oip_input(draw: st.DrawFn) -> dict[str, object]:
    datatype = draw(st.sampled_from([*sorted(DATATYPES), "FP8", ""]))
    shape = draw(shapes)
    out: dict[str, object] = {"name": draw(st.sampled_from(NAMES)), "shape": shape, "datatype": datatype}
    if draw(st.booleans()):
        out["data"] = draw(data_for(shape, datatype))
    if draw(st.booleans()):
        out["parameters"] = draw(params)
    return out


@st.composite
def oip_request(draw: st.DrawFn) -> dict[str, object]:
    req: dict[str, object] = {"inputs": draw(st.lists(oip_input(), max_size=3))}
    if draw(st.booleans()):
        req["id"] = draw(st.one_of(st.text(max_size=5), st.integers()))
    if draw(st.booleans()):
        req["parameters"] = draw(params)
    if draw(st.booleans()):
        req["outputs"] = draw(
            st.lists(st.fixed_dictionaries({"name": st.sampled_from(["O", "OUTPUT0", "Z"])}), max_size=2)
        )
    return req


@fuzz()
@given(oip_request(), st.sampled_from(CONFIGS))
def test_structured_json_requests_only_raise_bad_request(req: dict[str, object], config: ModelConfig) -> None:
    result = decode(json.dumps(req).encode(), None, config)
    if result is not None:
        assert 1 <= len(result.items) <= config.max_items_per_request


@fuzz()
@given(oip_request(), st.sampled_from(CONFIGS), st.binary(max_size=256))
def test_structured_binary_requests_only_raise_bad_request(
    req: dict[str, object], config: ModelConfig, tail: bytes
) -> None:
    head = json.dumps(req).encode()
    decode(head + tail, str(len(head)), config)


# ---- valid requests decode to what was sent ----------------------------------------------------------------
@st.composite
def valid_int32_bytes_request(draw: st.DrawFn) -> tuple[dict[str, object], list[list[int]], list[str]]:
    n = draw(st.integers(1, 8))
    a = draw(
        st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=2, max_size=2), min_size=n, max_size=n)
    )
    b = draw(st.lists(st.text(max_size=8), min_size=n, max_size=n))
    req = {
        "inputs": [
            {"name": "A", "shape": [n, 2], "datatype": "INT32", "data": a},
            {"name": "B", "shape": [n], "datatype": "BYTES", "data": b},
        ]
    }
    return req, a, b


@fuzz(0.5)
@given(valid_int32_bytes_request(), st.booleans())
def test_valid_requests_decode_to_their_rows(
    case: tuple[dict[str, object], list[list[int]], list[str]], as_binary: bool
) -> None:
    req, a, b = case
    try:
        encoded = [s.encode() for s in b]
    except UnicodeEncodeError:  # lone surrogates: refused as such
        return
    header_length = None
    body = json.dumps(req).encode()
    if as_binary:
        raw_a = np.asarray(a, dtype=np.int32).tobytes()
        raw_b = binary.encode_bytes_elements(encoded)
        inputs = req["inputs"]
        assert isinstance(inputs, list)
        for inp, raw in zip(inputs, (raw_a, raw_b), strict=True):
            del inp["data"]
            inp["parameters"] = {"binary_data_size": len(raw)}
        head = json.dumps(req).encode()
        body, header_length = head + raw_a + raw_b, str(len(head))
    result = oip.decode_request(body, header_length, CONFIGS[1])
    assert [list(item["A"]) for item in result.items] == a
    assert [item["B"] for item in result.items] == encoded


# ---- the binary codec on its own ---------------------------------------------------------------------------
@fuzz()
@given(st.binary(max_size=512), st.integers(0, 64))
def test_bytes_elements_decoder_only_raises_bad_request(raw: bytes, count: int) -> None:
    try:
        out = binary.decode_bytes_elements(memoryview(raw), count, "T")
    except BadRequest:
        return
    assert len(out) == count
    assert binary.encode_bytes_elements(out) == raw


@fuzz()
@given(st.lists(st.binary(max_size=40), max_size=20))
def test_bytes_elements_round_trip(values: list[bytes]) -> None:
    raw = binary.encode_bytes_elements(values)
    assert binary.decode_bytes_elements(memoryview(raw), len(values), "T") == values


@fuzz()
@given(st.binary(max_size=256), st.sampled_from(sorted(NUMPY_DTYPES)), st.integers(0, 64))
def test_numeric_decoder_only_raises_bad_request(raw: bytes, datatype: str, count: int) -> None:
    try:
        arr = binary.decode_numeric(memoryview(raw), datatype, count, "T")
    except BadRequest:
        return
    assert arr.size == count
    assert binary.encode_numeric(arr, datatype) == raw


def test_header_length_with_a_sign_or_underscore_is_refused() -> None:
    """int() accepts '+8', ' 8' and '1_0'; an HTTP length header is digits only."""
    for header in ("+8", "1_0", "-0", "\u0668"):
        with pytest.raises(BadRequest, match="Inference-Header-Content-Length"):
            binary.split_body(b'{"inputs":[]}xxxxxxxxxx', header)


def test_length_prefix_struct_is_little_endian() -> None:
    assert binary.encode_bytes_elements([b"ab"]) == struct.pack("<I", 2) + b"ab"
