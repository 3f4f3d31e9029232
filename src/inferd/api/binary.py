"""Triton's binary tensor data extension for OIP REST.

A request or response body is a JSON header followed by raw tensor bytes; the header's length is in
`Inference-Header-Content-Length`. Each tensor sent as binary carries `parameters.binary_data_size`
and no `data`; their bytes follow the JSON in the order the tensors are listed.
Numeric tensors are raw little-endian row-major; BYTES tensors are a sequence of
(4-byte little-endian length, bytes) elements.
"""

from __future__ import annotations

import struct

import numpy as np

from inferd.errors import BadRequest
from inferd.tensors import NUMPY_DTYPES

HEADER = "inference-header-content-length"
_U32 = struct.Struct("<I")


def split_body(body: bytes, header_length: str) -> tuple[bytes, memoryview]:
    digits = header_length.strip()
    if not (digits.isascii() and digits.isdigit()):  # int() would take '+8', '1_0' and non-ASCII digits
        raise BadRequest(f"Inference-Header-Content-Length must be an integer, got {header_length!r}")
    n = int(digits)
    if not 0 < n <= len(body):
        raise BadRequest(f"Inference-Header-Content-Length is {n} but the body has {len(body)} bytes")
    return body[:n], memoryview(body)[n:]


def decode_bytes_elements(raw: memoryview, count: int, name: str) -> list[bytes]:
    out: list[bytes] = []
    pos = 0
    end = len(raw)
    while pos < end:
        if pos + 4 > end:
            raise BadRequest(f"input {name!r}: truncated BYTES element length at offset {pos}")
        if len(out) == count:  # more than the shape holds: refused now, the rest never decoded
            raise BadRequest(f"input {name!r}: shape holds {count} elements but the binary data holds more")
        (length,) = _U32.unpack_from(raw, pos)
        pos += 4
        if pos + length > end:
            raise BadRequest(f"input {name!r}: BYTES element of {length} bytes runs past the tensor's data")
        out.append(bytes(raw[pos : pos + length]))
        pos += length
    if len(out) != count:
        raise BadRequest(f"input {name!r}: shape holds {count} elements but the binary data holds {len(out)}")
    return out


def decode_numeric(raw: memoryview, datatype: str, count: int, name: str) -> np.ndarray:
    dtype = NUMPY_DTYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise BadRequest(
            f"input {name!r}: shape holds {count} {datatype} elements ({count * dtype.itemsize} bytes) but "
            f"binary_data_size is {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype)


def encode_bytes_elements(values: list[bytes]) -> bytes:
    parts = []
    for v in values:
        parts.append(_U32.pack(len(v)))
        parts.append(v)
    return b"".join(parts)


def encode_numeric(arr: np.ndarray, datatype: str) -> bytes:
    return np.ascontiguousarray(arr, dtype=NUMPY_DTYPES[datatype]).tobytes()
