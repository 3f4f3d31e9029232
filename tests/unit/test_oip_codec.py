"""OIP request decoding and response encoding, without a server."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from inferd.api import oip
from inferd.config import ModelConfig, TensorSpec
from inferd.errors import BadRequest
from inferd.models.sim import sim_config


def two_inputs() -> ModelConfig:
    return ModelConfig(
        name="m",
        implementation="x:Y",
        max_batch_size=8,
        inputs=(TensorSpec(name="A", datatype="INT32", shape=(2,)), TensorSpec(name="B", datatype="BYTES")),
        outputs=(TensorSpec(name="O", datatype="FP32", shape=(-1,)),),
    )


def test_single_bytes_input_rows_are_bare_bytes() -> None:
    body = b'{"id":"7","inputs":[{"name":"INPUT0","shape":[2],"datatype":"BYTES","data":["a","\\u00e9"]}]}'
    req = oip.decode_request(body, None, sim_config())
    assert req.request_id == "7"
    assert req.items == [b"a", "é".encode()]


def test_nested_and_flat_data_decode_alike() -> None:
    cfg = two_inputs()
    flat = {
        "inputs": [
            {"name": "A", "shape": [2, 2], "datatype": "INT32", "data": [1, 2, 3, 4]},
            {"name": "B", "shape": [2], "datatype": "BYTES", "data": ["x", "y"]},
        ]
    }
    nested = json.loads(json.dumps(flat))
    nested["inputs"][0]["data"] = [[1, 2], [3, 4]]
    for body in (flat, nested):
        req = oip.decode_request(json.dumps(body).encode(), None, cfg)
        assert [list(i["A"]) for i in req.items] == [[1, 2], [3, 4]]
        assert [i["B"] for i in req.items] == [b"x", b"y"]


def test_binary_extension_request() -> None:
    cfg = two_inputs()
    a = np.array([[1, 2], [3, 4]], dtype=np.int32).tobytes()
    b = struct.pack("<I", 1) + b"x" + struct.pack("<I", 2) + b"yz"
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "A",
                    "shape": [2, 2],
                    "datatype": "INT32",
                    "parameters": {"binary_data_size": len(a)},
                },
                {"name": "B", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": len(b)}},
            ]
        }
    ).encode()
    req = oip.decode_request(header + a + b, str(len(header)), cfg)
    assert [i["B"] for i in req.items] == [b"x", b"yz"]
    assert req.items[1]["A"].tolist() == [3, 4]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"inputs":[{"name":"A","shape":[1,2],"datatype":"INT32","data":[1,2]}]}', "needs inputs ['B']"),
        (
            b'{"inputs":[{"name":"A","shape":[1,2],"datatype":"INT32","data":[1,2.5]},'
            b'{"name":"B","shape":[1],"datatype":"BYTES","data":["x"]}]}',
            "must be integers",
        ),
        (
            b'{"inputs":[{"name":"A","shape":[1,2],"datatype":"INT32","data":[1,99999999999]},'
            b'{"name":"B","shape":[1],"datatype":"BYTES","data":["x"]}]}',
            "out of range",
        ),
        (
            b'{"inputs":[{"name":"A","shape":[2,2],"datatype":"INT32","data":[1,2,3,4]},'
            b'{"name":"B","shape":[1],"datatype":"BYTES","data":["x"]}]}',
            "disagree on the batch dimension",
        ),
        (
            b'{"inputs":[{"name":"A","shape":[1,2],"datatype":"INT32","data":[1,2]},'
            b'{"name":"B","shape":[1],"datatype":"BYTES","data":[5]}]}',
            "elements must be strings",
        ),
        (
            b'{"inputs":[{"name":"A","shape":[1,2],"datatype":"INT32","data":[[[1]],2]},'
            b'{"name":"B","shape":[1],"datatype":"BYTES","data":["x"]}]}',
            "nested deeper than its shape",
        ),
        (
            b'{"inputs":[{"name":"A","shape":[0,2],"datatype":"INT32","data":[]},'
            b'{"name":"B","shape":[0],"datatype":"BYTES","data":[]}]}',
            "empty batch dimension",
        ),
        (
            b'{"inputs":[{"name":"A","shape":[1,2],"datatype":"INT32","data":[1,2]},'
            b'{"name":"A","shape":[1,2],"datatype":"INT32","data":[1,2]}]}',
            "sent twice",
        ),
        (
            b'{"inputs":[{"name":"B","shape":[1],"datatype":"BYTES","data":["\\ud800"]},'
            b'{"name":"A","shape":[1,2],"datatype":"INT32","data":[1,2]}]}',
            "surrogate",
        ),
        (b'{"inputs": [], "parameters": {"timeout": "soon"}}', "needs inputs"),
    ],
)
def test_bad_requests_name_the_problem(body: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        oip.decode_request(body, None, two_inputs())


def test_binary_sizes_must_add_up() -> None:
    header = (
        b'{"inputs":[{"name":"INPUT0","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":5}}]}'
    )
    payload = struct.pack("<I", 1) + b"x"
    with pytest.raises(BadRequest, match="binary"):
        oip.decode_request(header + payload + b"extra", str(len(header)), sim_config())
    with pytest.raises(BadRequest, match="Inference-Header-Content-Length"):
        oip.decode_request(header, "999999", sim_config())


def test_response_json_and_binary() -> None:
    cfg = ModelConfig(
        name="m",
        implementation="x:Y",
        inputs=(TensorSpec(name="I", datatype="FP32"),),
        outputs=(TensorSpec(name="V", datatype="FP32", shape=(3,)), TensorSpec(name="S", datatype="BYTES")),
    )
    rows = [
        {"V": np.array([1, 2, 3], np.float32), "S": b"a"},
        {"V": np.array([4, 5, 6], np.float32), "S": b"bc"},
    ]
    outs = [(cfg.outputs[0], False), (cfg.outputs[1], False)]
    body, header_len = oip.encode_response(cfg, 3, "id1", outs, rows, {"batch_id": 1})
    assert header_len is None
    doc = json.loads(body)
    assert doc["model_version"] == "3" and doc["id"] == "id1"
    assert doc["outputs"][0] == {"name": "V", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]}
    assert doc["outputs"][1]["data"] == ["a", "bc"]
    body, header_len = oip.encode_response(cfg, 3, None, [(cfg.outputs[0], True)], rows, {})
    assert header_len is not None
    head = json.loads(body[:header_len])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == 24
    assert np.frombuffer(body[header_len:], np.float32).tolist() == [1, 2, 3, 4, 5, 6]


def test_a_bytes_blob_holding_more_elements_than_its_shape_is_refused_once_it_passes_the_count() -> None:
    """A blob of empty elements costs 4 bytes each: decoding all of an 8 MiB one for a shape of one
    element would hold the event loop for most of a second. The decoder stops at the first element past
    the shape's count (here before the blob's truncated tail, which it never reaches)."""
    from inferd.api.binary import decode_bytes_elements

    raw = memoryview(struct.pack("<II", 0, 0) + b"\x01\x00")  # two empty elements, then 2 stray bytes
    with pytest.raises(BadRequest, match=r"shape holds 1 elements but the binary data holds more"):
        decode_bytes_elements(raw, 1, "x")
    with pytest.raises(BadRequest, match=r"shape holds 3 elements but the binary data holds 2"):
        decode_bytes_elements(memoryview(struct.pack("<II", 0, 0)), 3, "x")
    assert decode_bytes_elements(memoryview(struct.pack("<I", 2) + b"ab"), 1, "x") == [b"ab"]
