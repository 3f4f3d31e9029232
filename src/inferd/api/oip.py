"""KServe Open Inference Protocol v2 over REST: JSON request decoding (with Triton's binary tensor
extension) and response encoding.

Decoding turns one request into batch items (one per row of the batch dimension), checking everything
against the model's declared tensors before anything is queued (api/oip_tensors.py: the checks every
edge shares with the gRPC one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np

from inferd.api import binary
from inferd.api.http import decode_json
from inferd.api.oip_tensors import Columns, DecodedRequest, Param, column, from_binary, schema
from inferd.config import ModelConfig, TensorSpec
from inferd.errors import BadRequest
from inferd.tensors import FLOAT_TYPES, NUMPY_DTYPES

__all__ = ["DecodedRequest", "InferRequest", "InferResponse", "decode_request", "encode_json", "encode_response"]

class RequestInput(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    data: Any = msgspec.UNSET
    parameters: dict[str, Param] = {}


class RequestOutput(msgspec.Struct):
    name: str
    parameters: dict[str, Param] = {}


class InferRequest(msgspec.Struct):
    inputs: list[RequestInput]
    id: str | None = None
    parameters: dict[str, Param] = {}
    outputs: list[RequestOutput] | None = None


class ResponseOutput(msgspec.Struct, omit_defaults=True):
    name: str
    datatype: str
    shape: list[int]
    data: Any = msgspec.UNSET
    parameters: dict[str, Param] | msgspec.UnsetType = msgspec.UNSET


class InferResponse(msgspec.Struct, omit_defaults=True):
    model_name: str
    model_version: str
    outputs: list[ResponseOutput]
    id: str | msgspec.UnsetType = msgspec.UNSET
    parameters: dict[str, Param] | msgspec.UnsetType = msgspec.UNSET


_request_decoder = msgspec.json.Decoder(InferRequest)
_encoder = msgspec.json.Encoder()


def decode_request(body: bytes, header_length: str | None, config: ModelConfig) -> DecodedRequest:
    raw_tail: memoryview | None = None
    if header_length is not None:
        body, raw_tail = binary.split_body(body, header_length)
    req = decode_json(_request_decoder, body, "inference request", "send an OIP inference request as JSON")
    items = _decode_inputs(req.inputs, config, raw_tail)
    return DecodedRequest(
        request_id=req.id,
        items=items,
        outputs=_requested_outputs(req, config, raw_tail is not None),
        timeout_us=_number_param(req.parameters, "timeout"),
        priority=req.parameters.get("priority"),
    )


def _decode_inputs(inputs: list[RequestInput], config: ModelConfig, raw: memoryview | None) -> list[Any]:
    columns = Columns(config, len(inputs))
    offset = 0
    for inp in inputs:
        spec, count = columns.check(inp.name, inp.datatype, inp.shape)
        size = inp.parameters.get("binary_data_size")
        if size is not None:
            if raw is None:
                raise BadRequest(
                    f"input {inp.name!r} has binary_data_size but no Inference-Header-Content-Length"
                )
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(raw):
                raise BadRequest(
                    f"input {inp.name!r}: binary_data_size {size!r} does not fit the binary data"
                )
            columns.put(spec, from_binary(raw[offset : offset + size], spec, count))
            offset += size
        else:
            if inp.data is msgspec.UNSET:
                raise BadRequest(f"input {inp.name!r} has neither data nor binary_data_size")
            columns.put(spec, _from_json(inp.data, spec, count, len(inp.shape)))
    items = columns.items()
    if raw is not None and offset != len(raw):
        raise BadRequest(f"{len(raw) - offset} bytes of binary data are not claimed by any input")
    return items


def _flatten(data: Any, depth: int, name: str) -> list[Any]:
    """Row-major flatten of flat or nested JSON data, nesting at most `depth` levels (iterative, so a
    hostile nesting depth cannot exhaust the stack)."""
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                if len(stack) >= depth:
                    raise BadRequest(f"input {name!r}: data is nested deeper than its shape")
                stack.append(iter(x))
                break
            out.append(x)
        else:
            stack.pop()
    return out


def _from_json(data: Any, spec: TensorSpec, count: int, depth: int) -> Any:
    flat = _flatten(data, depth, spec.name)
    if len(flat) != count:
        raise BadRequest(f"input {spec.name!r}: shape holds {count} elements but data has {len(flat)}")
    if spec.datatype == "BYTES":
        out = []
        for x in flat:
            if not isinstance(x, str):
                raise BadRequest(
                    f"input {spec.name!r} is BYTES: elements must be strings, got {type(x).__name__}"
                )
            try:
                out.append(x.encode())
            except UnicodeEncodeError:
                raise BadRequest(
                    f"input {spec.name!r}: element is not valid Unicode (lone surrogate)"
                ) from None
        return out
    if spec.datatype == "BOOL":
        if not all(isinstance(x, bool) for x in flat):
            raise BadRequest(f"input {spec.name!r} is BOOL: elements must be true or false")
        return np.asarray(flat, dtype=np.bool_)
    if spec.datatype in ("FP16",):
        raise BadRequest(f"input {spec.name!r} is FP16: send it as binary data")
    for x in flat:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise BadRequest(f"input {spec.name!r} is {spec.datatype}: element {x!r} is not a number")
    dtype = NUMPY_DTYPES[spec.datatype]
    if spec.datatype not in FLOAT_TYPES and any(isinstance(x, float) for x in flat):
        raise BadRequest(f"input {spec.name!r} is {spec.datatype}: elements must be integers")
    try:
        arr = np.asarray(flat, dtype=dtype)
    except OverflowError:
        raise BadRequest(f"input {spec.name!r}: a value is out of range for {spec.datatype}") from None
    if spec.datatype in FLOAT_TYPES and not np.isfinite(arr).all():
        raise BadRequest(f"input {spec.name!r}: values must be finite (NaN or Inf found or overflowed)")
    return arr


def _requested_outputs(
    req: InferRequest, config: ModelConfig, binary_request: bool
) -> list[tuple[TensorSpec, bool]]:
    found = schema(config)
    default_binary = bool(req.parameters.get("binary_data_output", False)) if req.parameters else False
    if req.outputs is None:
        return found.all_binary if default_binary else found.all_json
    specs = found.outputs
    chosen = []
    for out in req.outputs:
        spec = specs.get(out.name)
        if spec is None:
            raise BadRequest(f"unknown output {out.name!r} for model '{config.name}'; it has {sorted(specs)}")
        chosen.append((spec, bool(out.parameters.get("binary_data", default_binary))))
    return chosen


def _number_param(params: Mapping[str, Param], key: str) -> float | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"parameter {key!r} must be a number, got {value!r}")
    return float(value)


# ---- responses ---------------------------------------------------------------------------------------


def encode_response(
    config: ModelConfig,
    version: int,
    request_id: str | None,
    outputs: list[tuple[TensorSpec, bool]],
    rows: list[dict[str, Any]],
    parameters: dict[str, Param],
) -> tuple[bytes, int | None]:
    """Returns (body, JSON header length if any output is binary, else None)."""
    n = len(rows)
    encoded: list[ResponseOutput] = []
    blobs: list[bytes] = []
    for spec, as_binary in outputs:
        shape, values = column(spec, [r[spec.name] for r in rows], n)
        if as_binary:
            blob = (
                binary.encode_bytes_elements(values)
                if spec.datatype == "BYTES"
                else binary.encode_numeric(values, spec.datatype)
            )
            blobs.append(blob)
            encoded.append(
                ResponseOutput(spec.name, spec.datatype, shape, parameters={"binary_data_size": len(blob)})
            )
        else:
            data = (
                [v.decode("utf-8", "replace") for v in values]
                if spec.datatype == "BYTES"
                else _json_numbers(values)
            )
            encoded.append(ResponseOutput(spec.name, spec.datatype, shape, data=data))
    resp = InferResponse(
        model_name=config.name,
        model_version=str(version),
        outputs=encoded,
        id=request_id if request_id is not None else msgspec.UNSET,
        parameters=parameters,
    )
    head = _encoder.encode(resp)
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)


def _json_numbers(values: np.ndarray) -> list[Any]:
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        return [None if not math.isfinite(v) else v for v in values.ravel().tolist()]
    return values.ravel().tolist()


def encode_json(obj: Any) -> bytes:
    return _encoder.encode(obj)
