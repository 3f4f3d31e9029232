"""An OIP request's tensors against the model's declared ones, whatever wire carried them (REST's JSON,
Triton's binary extension, gRPC's typed contents or raw_input_contents): the checks every edge makes
before anything is allocated or queued, the batch items they become, and an answer's output columns.

An edge reads each input's name, datatype and shape from its wire and hands them to `Columns.check`
(unknown or repeated inputs, datatypes, shapes, the batch dimension, the element count: all checked
before the edge touches the data), then the decoded column to `Columns.put`; `Columns.items()` checks
that none is missing and cuts the columns into one item per row of the batch dimension.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferd.api import binary
from inferd.config import ModelConfig, TensorSpec
from inferd.errors import BadRequest
from inferd.tensors import DATATYPES, FLOAT_TYPES, NUMPY_DTYPES

MAX_ELEMENTS = 2**27
"""Largest element count of one input tensor (shapes beyond are refused before any allocation)."""

Param = str | int | float | bool


@dataclass(frozen=True, slots=True)
class Schema:
    """What decoding needs of a model's config, computed once per config."""

    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    all_json: list[tuple[TensorSpec, bool]]
    all_binary: list[tuple[TensorSpec, bool]]


_schemas: dict[int, tuple[ModelConfig, Schema]] = {}


def schema(config: ModelConfig) -> Schema:
    cached = _schemas.get(id(config))
    if cached is not None and cached[0] is config:
        return cached[1]
    found = Schema(
        inputs={t.name: t for t in config.inputs},
        outputs={t.name: t for t in config.outputs},
        all_json=[(t, False) for t in config.outputs],
        all_binary=[(t, True) for t in config.outputs],
    )
    _schemas[id(config)] = (config, found)
    return found


@dataclass(frozen=True, slots=True)
class DecodedRequest:
    request_id: str | None
    items: list[Any]
    """One entry per row of the batch dimension, in the form the model API hands to predict_batch."""
    outputs: list[tuple[TensorSpec, bool]]
    """Requested outputs, each with whether it is returned as binary data (REST; gRPC: always raw)."""
    timeout_us: float | None
    priority: Param | None


class Columns:
    """The inputs of one request, checked one by one as an edge reads them, then cut into items."""

    __slots__ = ("batch", "columns", "config", "specs")

    def __init__(self, config: ModelConfig, sent: int) -> None:
        """`sent`: how many inputs the request carries (more than the model takes is refused now)."""
        self.config = config
        self.specs = specs = schema(config).inputs
        if sent > len(specs):
            raise BadRequest(
                f"{sent} inputs sent; model '{config.name}' takes {len(specs)}: {sorted(specs)}"
            )
        self.columns: dict[str, Any] = {}
        self.batch: int | None = None

    def check(self, name: str, datatype: str, shape: Sequence[int]) -> tuple[TensorSpec, int]:
        """The declared tensor `name` is, and how many elements `shape` holds: BadRequest naming the input
        when it is unknown, sent twice, of another datatype, shape or batch size than the others."""
        spec = self.specs.get(name)
        if spec is None:
            raise BadRequest(
                f"unknown input {name!r} for model '{self.config.name}'; it takes {sorted(self.specs)}"
            )
        if name in self.columns:
            raise BadRequest(f"input {name!r} sent twice")
        n, count = check_shape(name, datatype, shape, spec, self.config)
        if self.batch is not None and n != self.batch:
            raise BadRequest(f"inputs disagree on the batch dimension: {name!r} has {n}, others {self.batch}")
        self.batch = n
        return spec, count

    def put(self, spec: TensorSpec, column: Any) -> None:
        self.columns[spec.name] = column

    def items(self) -> list[Any]:
        """One item per row (BadRequest naming the inputs the model needs and the request lacks)."""
        columns = self.columns
        if len(columns) != len(self.specs):
            missing = sorted(set(self.specs) - set(columns))
            raise BadRequest(f"model '{self.config.name}' needs inputs {missing}")
        assert self.batch is not None  # a model takes at least one input, and each was checked
        return to_items(columns, self.config, self.batch)


def check_shape(
    name: str, datatype: str, shape: Sequence[int], spec: TensorSpec, config: ModelConfig
) -> tuple[int, int]:
    """(rows, elements) of an input of `shape`, checked against its declaration `spec`."""
    if datatype != spec.datatype:
        if datatype not in DATATYPES:
            raise BadRequest(f"input {name!r}: unknown datatype {datatype!r}; use one of {sorted(DATATYPES)}")
        raise BadRequest(f"input {name!r} must be {spec.datatype}, got {datatype}")
    per_item = spec.shape
    if len(shape) != 1 + len(per_item):
        want = [-1, *per_item]
        raise BadRequest(
            f"input {name!r} has shape {list(shape)}; model '{config.name}' expects {want} "
            "(the first dimension is the batch)"
        )
    if min(shape) < 0:
        raise BadRequest(f"input {name!r} has a negative dimension in shape {list(shape)}")
    if per_item:  # a scalar per item (the common case) has no per-item dimensions to check
        for want, got in zip(per_item, shape[1:], strict=True):
            if want != -1 and want != got:
                raise BadRequest(
                    f"input {name!r} has shape {list(shape)}; per-item shape must be {list(per_item)}"
                )
    n = shape[0]
    if n < 1:
        raise BadRequest(f"input {name!r} has an empty batch dimension (shape {list(shape)})")
    if n > config.max_items_per_request:
        raise BadRequest(
            f"input {name!r} carries {n} items; model '{config.name}' takes at most "
            f"{config.max_items_per_request} per request"
        )
    count = math.prod(shape) if per_item else n
    if count > MAX_ELEMENTS:
        raise BadRequest(f"input {name!r} shape {list(shape)} holds {count} elements (limit {MAX_ELEMENTS})")
    return n, count


def from_binary(raw: memoryview | bytes, spec: TensorSpec, count: int) -> Any:
    """An input's column from its raw bytes (Triton's binary layout: little-endian numbers, BYTES as
    length-prefixed elements), viewed in place where numpy allows."""
    if spec.datatype == "BYTES":
        return binary.decode_bytes_elements(memoryview(raw), count, spec.name)
    arr = binary.decode_numeric(raw, spec.datatype, count, spec.name)
    check_finite(arr, spec)
    return arr


def check_finite(arr: np.ndarray, spec: TensorSpec) -> None:
    if spec.datatype in FLOAT_TYPES and not np.isfinite(arr).all():
        raise BadRequest(f"input {spec.name!r}: values must be finite (NaN or Inf found)")


def to_items(columns: dict[str, Any], config: ModelConfig, n: int) -> list[Any]:
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


# ---- answers -----------------------------------------------------------------------------------------


def column(spec: TensorSpec, column: list[Any], n: int) -> tuple[list[int], Any]:
    """An output's shape and values over the `n` rows of an answer: a list of bytes for BYTES, else a
    numpy array of the declared datatype."""
    if spec.shape == ():
        if spec.datatype == "BYTES":
            return [n], column
        return [n], np.asarray(column, dtype=NUMPY_DTYPES[spec.datatype])
    if spec.datatype == "BYTES":
        arr = np.stack([np.asarray(c, dtype=object) for c in column])
        return list(arr.shape), [x if isinstance(x, bytes) else str(x).encode() for x in arr.ravel().tolist()]
    arr = np.stack(column).astype(NUMPY_DTYPES[spec.datatype], copy=False)
    return list(arr.shape), arr
