"""KServe Open Inference Protocol v2: request decoding and validation, response encoding.

Decoding turns one request into batch items (one per row of the batch dimension), checking everything
against the model's declared tensors before anything is queued.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from inferd.api import binary
from inferd.api.http import decode_json
from inferd.config import ModelConfig, TensorSpec
from inferd.errors import BadRequest
from inferd.tensors import DATATYPES, FLOAT_TYPES, NUMPY_DTYPES

MAX_ELEMENTS = 2**27
"""Largest element count of one input tensor (shapes beyond are refused before any allocation)."""

Param = str | int | float | bool


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


@dataclass(frozen=True, slots=True)
class _Schema:
    """What decoding needs of a model's config, computed once per config."""

    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    all_json: list[tuple[TensorSpec, bool]]
    all_binary: list[tuple[TensorSpec, bool]]


_schemas: dict[int, tuple[ModelConfig, _Schema]] = {}


def _schema(config: ModelConfig) -> _Schema:
    cached = _schemas.get(id(config))
    if cached is not None and cached[0] is config:
        return cached[1]
    schema = _Schema(
        inputs={t.name: t for t in config.inputs},
        outputs={t.name: t for t in config.outputs},
        all_json=[(t, False) for t in config.outputs],
        all_binary=[(t, True) for t in config.outputs],
    )
    _schemas[id(config)] = (config, schema)
    return schema


@dataclass(frozen=True, slots=True)
class DecodedRequest:
    request_id: str | None
    items: list[Any]
    """One entry per row of the batch dimension, in the form the model API hands to predict_batch."""
    outputs: list[tuple[TensorSpec, bool]]
    """Requested outputs, each with whether it is returned as binary data."""
    timeout_us: float | None
    priority: Param | None


def decode_request(body: bytes, header_length: str | None, config: ModelConfig) -> DecodedRequest:
    raw_tail: memoryview | None = None
    if header_length is not None:
        body, raw_tail = binary.split_body(body, header_length)
    req = decode_json(_request_decoder, body, "inference request", "send an OIP inference request as JSON")
    columns, n = _decode_inputs(req.inputs, config, raw_tail)
    items = _to_items(columns, config, n)
    return DecodedRequest(
        request_id=req.id,
        items=items,
        outputs=_requested_outputs(req, config, raw_tail is not None),
        timeout_us=_number_param(req.parameters, "timeout"),
        priority=req.parameters.get("priority"),
    )


def _decode_inputs(
    inputs: list[RequestInput], config: ModelConfig, raw: memoryview | None
) -> tuple[dict[str, Any], int]:
    specs = _schema(config).inputs
    if len(inputs) > len(specs):
        raise BadRequest(
            f"{len(inputs)} inputs sent; model '{config.name}' takes {len(specs)}: {sorted(specs)}"
        )
    columns: dict[str, Any] = {}
    batch: int | None = None
    offset = 0
    for inp in inputs:
        spec = specs.get(inp.name)
        if spec is None:
            raise BadRequest(
                f"unknown input {inp.name!r} for model '{config.name}'; it takes {sorted(specs)}"
            )
        if inp.name in columns:
            raise BadRequest(f"input {inp.name!r} sent twice")
        n, count = _check_shape(inp, spec, config)
        if batch is not None and n != batch:
            raise BadRequest(f"inputs disagree on the batch dimension: {inp.name!r} has {n}, others {batch}")
        batch = n
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
            columns[inp.name] = _from_binary(raw[offset : offset + size], spec, count)
            offset += size
        else:
            if inp.data is msgspec.UNSET:
                raise BadRequest(f"input {inp.name!r} has neither data nor binary_data_size")
            columns[inp.name] = _from_json(inp.data, spec, count, len(inp.shape))
    missing = sorted(set(specs) - set(columns)) if len(columns) != len(specs) else None
    if missing:
        raise BadRequest(f"model '{config.name}' needs inputs {missing}")
    if raw is not None and offset != len(raw):
        raise BadRequest(f"{len(raw) - offset} bytes of binary data are not claimed by any input")
    assert batch is not None
    return columns, batch


def _check_shape(inp: RequestInput, spec: TensorSpec, config: ModelConfig) -> tuple[int, int]:
    if inp.datatype != spec.datatype:
        if inp.datatype not in DATATYPES:
            raise BadRequest(
                f"input {inp.name!r}: unknown datatype {inp.datatype!r}; use one of {sorted(DATATYPES)}"
            )
        raise BadRequest(f"input {inp.name!r} must be {spec.datatype}, got {inp.datatype}")
    shape = inp.shape
    per_item = spec.shape
    if len(shape) != 1 + len(per_item):
        want = [-1, *per_item]
        raise BadRequest(
            f"input {inp.name!r} has shape {shape}; model '{config.name}' expects {want} "
            "(the first dimension is the batch)"
        )
    if min(shape) < 0:
        raise BadRequest(f"input {inp.name!r} has a negative dimension in shape {shape}")
    if per_item:  # a scalar per item (the common case) has no per-item dimensions to check
        for want, got in zip(per_item, shape[1:], strict=True):
            if want != -1 and want != got:
                raise BadRequest(
                    f"input {inp.name!r} has shape {shape}; per-item shape must be {list(per_item)}"
                )
    n = shape[0]
    if n < 1:
        raise BadRequest(f"input {inp.name!r} has an empty batch dimension (shape {shape})")
    if n > config.max_items_per_request:
        raise BadRequest(
            f"input {inp.name!r} carries {n} items; model '{config.name}' takes at most "
            f"{config.max_items_per_request} per request"
        )
    count = math.prod(shape) if per_item else n
    if count > MAX_ELEMENTS:
        raise BadRequest(f"input {inp.name!r} shape {shape} holds {count} elements (limit {MAX_ELEMENTS})")
    return n, count


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


def _from_binary(raw: memoryview, spec: TensorSpec, count: int) -> Any:
    if spec.datatype == "BYTES":
        return binary.decode_bytes_elements(raw, count, spec.name)
    arr = binary.decode_numeric(raw, spec.datatype, count, spec.name)
    if spec.datatype in FLOAT_TYPES and not np.isfinite(arr).all():
        raise BadRequest(f"input {spec.name!r}: values must be finite (NaN or Inf found)")
    return arr


def _to_items(columns: dict[str, Any], config: ModelConfig, n: int) -> list[Any]:
    rows: dict[str, list[Any]] = {}
    for spec in config.inputs:
        col = columns[spec.name]
        if spec.shape == ():
            rows[spec.name] = col if isinstance(col, list) else col.tolist()
        elif isinstance(col, list):
            arr = np.empty(len(col), dtype=object)
            arr[:] = col
            rows[spec.name] = list(arr.reshape(n, *_concrete(spec, len(col) // n)))
        else:
            rows[spec.name] = list(col.reshape(n, -1).reshape(n, *_concrete(spec, col.size // n)))
    if len(config.inputs) == 1:
        return rows[config.inputs[0].name]
    names = [s.name for s in config.inputs]
    return [{name: rows[name][i] for name in names} for i in range(n)]


def _concrete(spec: TensorSpec, per_item: int) -> tuple[int, ...]:
    known = math.prod(d for d in spec.shape if d != -1)
    free = [i for i, d in enumerate(spec.shape) if d == -1]
    if not free:
        return spec.shape
    dims = list(spec.shape)
    dims[free[0]] = per_item // max(known, 1)
    for i in free[1:]:
        dims[i] = 1
    return tuple(dims)


def _requested_outputs(
    req: InferRequest, config: ModelConfig, binary_request: bool
) -> list[tuple[TensorSpec, bool]]:
    schema = _schema(config)
    default_binary = bool(req.parameters.get("binary_data_output", False)) if req.parameters else False
    if req.outputs is None:
        return schema.all_binary if default_binary else schema.all_json
    specs = schema.outputs
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
        column = [r[spec.name] for r in rows]
        shape, values = _column(spec, column, n)
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


def _column(spec: TensorSpec, column: list[Any], n: int) -> tuple[list[int], Any]:
    if spec.shape == ():
        if spec.datatype == "BYTES":
            return [n], column
        return [n], np.asarray(column, dtype=NUMPY_DTYPES[spec.datatype])
    if spec.datatype == "BYTES":
        arr = np.stack([np.asarray(c, dtype=object) for c in column])
        return list(arr.shape), [x if isinstance(x, bytes) else str(x).encode() for x in arr.ravel().tolist()]
    arr = np.stack(column).astype(NUMPY_DTYPES[spec.datatype], copy=False)
    return list(arr.shape), arr


def _json_numbers(values: np.ndarray) -> list[Any]:
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        return [None if not math.isfinite(v) else v for v in values.ravel().tolist()]
    return values.ravel().tolist()


def encode_json(obj: Any) -> bytes:
    return _encoder.encode(obj)
