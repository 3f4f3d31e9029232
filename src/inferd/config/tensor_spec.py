"""One input or output tensor of a model (a model.toml's [[inputs]] and [[outputs]]): `TensorSpec`, and the
OIP datatypes it may name. Re-exported by inferd.config, where models and tools import it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]


class TensorSpec(BaseModel):
    """One input or output tensor of a model, per batch item (the batch dimension is implicit)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    """Tensor name as used in OIP requests."""
    datatype: Datatype
    """OIP datatype, e.g. FP32 or BYTES."""
    shape: tuple[int, ...] = ()
    """Shape of one item, without the batch dimension; -1 marks a variable dimension; () is a scalar."""

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        for d in shape:
            if d < -1 or d == 0:
                raise ValueError(
                    f"dimension {d} in shape {list(shape)}: use a positive size or -1 for variable"
                )
        return shape
