"""Triton's ModelInferRequest -> the `DecodedRequest` the REST edge builds (api/oip_tensors.py: the same
checks, in the same order, with the same messages), and an `Inference` -> ModelInferResponse.

Inputs come either all in `raw_input_contents` (what tritonclient sends: one blob per input, in the
inputs' order, numbers little-endian, BYTES as 4-byte length-prefixed elements: Triton's binary layout)
or each in its typed `contents` (other clients); never both. Every shape, datatype and element count is
checked before anything is allocated; a raw numeric tensor is viewed in place (np.frombuffer), never
copied. Outputs always go in `raw_output_contents`, as Triton answers. Request parameters read as on
REST: `timeout` (microseconds), `priority`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from inferd.api import binary
from inferd.api.oip_answer import Inference
from inferd.api.oip_tensors import Columns, DecodedRequest, Param, check_finite, column, from_binary, schema
from inferd.config import ModelConfig, TensorSpec
from inferd.errors import BadRequest
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.tensors import NUMPY_DTYPES

_TYPED: dict[str, tuple[str, np.dtype]] = {
    "BOOL": ("bool_contents", np.dtype(np.bool_)),
    "INT8": ("int_contents", np.dtype(np.int32)),
    "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)),
    "INT64": ("int64_contents", np.dtype(np.int64)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)),
    "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)),
    "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)),
    "FP64": ("fp64_contents", np.dtype(np.float64)),
    "BYTES": ("bytes_contents", np.dtype(object)),
}
"""Each datatype's typed contents field and the dtype it holds (FP16 and BF16 have none: raw only)."""


class GrpcOip:
    """A ModelInferRequest as api/oip_answer.py's `OipSource`: the message is here already, decoded by
    grpc within the size bound (grpc.max_receive_message_length)."""

    __slots__ = ("message",)

    def __init__(self, message: pb.ModelInferRequest) -> None:
        self.message = message

    async def read(self) -> None:
        return None

    def decode(self, config: ModelConfig) -> DecodedRequest:
        return decode_request(self.message, config)


def decode_request(message: pb.ModelInferRequest, config: ModelConfig) -> DecodedRequest:
    """The request's items and requested outputs, checked against `config` (BadRequest naming what is
    wrong, before any allocation)."""
    inputs = message.inputs
    raw = message.raw_input_contents
    if raw and len(raw) != len(inputs):
        raise BadRequest(
            f"raw_input_contents has {len(raw)} entries but the request has {len(inputs)} inputs: send one "
            "per input, in the inputs' order"
        )
    columns = Columns(config, len(inputs))
    for i, inp in enumerate(inputs):
        spec, count = columns.check(inp.name, inp.datatype, inp.shape)
        if raw:
            if inp.HasField("contents"):
                raise BadRequest(
                    f"input {inp.name!r} has contents while the request has raw_input_contents: send one"
                )
            columns.put(spec, from_binary(raw[i], spec, count))
        elif inp.HasField("contents"):
            columns.put(spec, _typed(inp.contents, spec, count))
        else:
            raise BadRequest(f"input {inp.name!r} has neither contents nor raw_input_contents")
    items = columns.items()
    timeout_us, priority = request_parameters(message)
    return DecodedRequest(
        request_id=message.id or None,
        items=items,
        outputs=_requested_outputs(message, config),
        timeout_us=timeout_us,
        priority=priority,
    )


def request_parameters(message: pb.ModelInferRequest) -> tuple[float | None, Param | None]:
    """The request's `timeout` (microseconds) and `priority` parameters, as REST reads them (None: not
    given); BadRequest for a timeout that is not a number."""
    params = message.parameters
    if not params:
        return None, None
    return _number_param(params, "timeout"), _param(params["priority"]) if "priority" in params else None


def _typed(contents: pb.InferTensorContents, spec: TensorSpec, count: int) -> Any:
    typed = _TYPED.get(spec.datatype)
    if typed is None:
        raise BadRequest(f"input {spec.name!r} is {spec.datatype}: send it in raw_input_contents")
    field, wire = typed
    values = getattr(contents, field)
    if len(values) != count:
        raise BadRequest(
            f"input {spec.name!r}: shape holds {count} elements but {field} has {len(values)}"
        )
    if spec.datatype == "BYTES":
        return list(values)
    arr = np.array(values, dtype=wire)
    dtype = NUMPY_DTYPES[spec.datatype]
    if dtype != wire:  # INT8/16 and UINT8/16 travel in 32-bit fields
        info = np.iinfo(dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise BadRequest(f"input {spec.name!r}: a value is out of range for {spec.datatype}")
        arr = arr.astype(dtype)
    check_finite(arr, spec)
    return arr


def _requested_outputs(message: pb.ModelInferRequest, config: ModelConfig) -> list[tuple[TensorSpec, bool]]:
    found = schema(config)
    if not message.outputs:
        return found.all_binary
    chosen = []
    for out in message.outputs:
        spec = found.outputs.get(out.name)
        if spec is None:
            raise BadRequest(
                f"unknown output {out.name!r} for model '{config.name}'; it has {sorted(found.outputs)}"
            )
        chosen.append((spec, True))
    return chosen


def _param(p: pb.InferParameter) -> Param | None:
    choice = p.WhichOneof("parameter_choice")
    return None if choice is None else getattr(p, choice)


def _number_param(params: Any, key: str) -> float | None:
    if key not in params:
        return None
    value = _param(params[key])
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"parameter {key!r} must be a number, got {value!r}")
    return float(value)


def encode_response(done: Inference) -> pb.ModelInferResponse:
    """The answer as Triton gives it: every output's tensor in raw_output_contents, in order."""
    rows = done.rows
    n = len(rows)
    outputs = []
    raws = []
    for spec, _ in done.request.outputs:
        shape, values = column(spec, [r[spec.name] for r in rows], n)
        datatype = spec.datatype
        outputs.append(pb.ModelInferResponse.InferOutputTensor(name=spec.name, datatype=datatype, shape=shape))
        raws.append(
            binary.encode_bytes_elements(values) if datatype == "BYTES" else binary.encode_numeric(values, datatype)
        )
    return pb.ModelInferResponse(
        model_name=done.runtime.config.name,
        model_version=str(done.version),
        id=done.request.request_id or "",
        outputs=outputs,
        raw_output_contents=raws,
    )
