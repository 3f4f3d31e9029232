"""Turn what a model's predict_batch returned into checked, typed per-item outputs (worker side)."""

from __future__ import annotations

from typing import Any

import numpy as np

from inferd.config import ModelConfig, TensorSpec
from inferd.tensors import NUMPY_DTYPES


class OutputError(ValueError):
    pass


def convert_outputs(config: ModelConfig, outputs: Any, n_items: int) -> tuple[list[Any], dict[int, str]]:
    """Returns (per-item outputs as {name: value}, {item index: error message}).
    Raises OutputError when the batch as a whole is wrong (not a list, wrong length)."""
    if not isinstance(outputs, (list, tuple)):
        raise OutputError(
            f"model '{config.name}' predict_batch returned {type(outputs).__name__}, expected a list of "
            f"{n_items} outputs"
        )
    if len(outputs) != n_items:
        raise OutputError(
            f"model '{config.name}' returned {len(outputs)} outputs for a batch of {n_items} inputs"
        )
    single = config.outputs[0] if len(config.outputs) == 1 else None
    # one BYTES scalar per item (sim's digests, a label): a str or bytes out needs no more than encoding
    text = single.name if single is not None and single.shape == () and single.datatype == "BYTES" else None
    converted: list[Any] = []
    errors: dict[int, str] = {}
    for index, out in enumerate(outputs):
        try:
            kind = type(out)
            if text is not None and (kind is str or kind is bytes):
                converted.append({text: out.encode() if kind is str else out})
            elif single is not None and not (isinstance(out, dict) and single.name in out):
                converted.append({single.name: _convert(single, out)})
            else:
                if not isinstance(out, dict):
                    raise OutputError(f"expected a dict of outputs {[t.name for t in config.outputs]}")
                converted.append({spec.name: _convert(spec, _pick(out, spec)) for spec in config.outputs})
        except (OutputError, ValueError, TypeError, OverflowError) as exc:
            converted.append(None)
            errors[index] = f"model '{config.name}' output for item {index} is invalid: {exc}"
    return converted, errors


def _pick(out: dict[str, Any], spec: TensorSpec) -> Any:
    if spec.name not in out:
        raise OutputError(f"output {spec.name!r} missing (got {sorted(out)})")
    return out[spec.name]


def _convert(spec: TensorSpec, value: Any) -> Any:
    if spec.shape == ():
        return _scalar(spec, value)
    if spec.datatype == "BYTES":
        arr = np.asarray(value, dtype=object)
        arr = np.vectorize(lambda x: x if isinstance(x, bytes) else str(x).encode(), otypes=[object])(arr)
    else:
        arr = np.asarray(value, dtype=NUMPY_DTYPES[spec.datatype])
    _check_shape(spec, arr.shape)
    return arr


def _scalar(spec: TensorSpec, value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise OutputError(f"{spec.name} should be a scalar, got shape {list(value.shape)}")
        value = value.reshape(()).item()
    elif isinstance(value, np.generic):
        value = value.item()
    if spec.datatype == "BYTES":
        if isinstance(value, bytes):
            return value
        if isinstance(value, str):
            return value.encode()
        raise OutputError(f"{spec.name} is BYTES, got {type(value).__name__}")
    if spec.datatype == "BOOL":
        return bool(value)
    if spec.datatype.startswith(("INT", "UINT")):
        if isinstance(value, float) and not value.is_integer():
            raise OutputError(f"{spec.name} is {spec.datatype}, got non-integer {value}")
        return int(value)
    return float(value)


def _check_shape(spec: TensorSpec, shape: tuple[int, ...]) -> None:
    ok = len(shape) == len(spec.shape) and all(
        d == -1 or d == s for d, s in zip(spec.shape, shape, strict=True)
    )
    if not ok:
        raise OutputError(
            f"{spec.name} has shape {list(shape)}, declared per-item shape is {list(spec.shape)}"
        )
