"""Each request `inferd bench` sends: its id, its unique payload and OIP v2 body, and the check that an
answer is its own.

The response id must be the id we sent and OUTPUT0 must be `sim_digest(model_name, model_version,
payload)`; an answer that fails either check is `mismatched` (it belongs to another caller, or to nobody).
The check is the same over REST and gRPC; only the reading of the answer's fields differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

_BODY_HEAD = b'{"id":"'
_BODY_MID = b'","inputs":[{"name":"INPUT0","shape":[1],"datatype":"BYTES","data":["'
_BODY_TAIL = b'"]}]}'


def request_id(seed: int, i: int) -> str:
    return f"{seed}-{i}"


def payload_for(seed: int, i: int, payload_bytes: int) -> str:
    """Unique per request: `"{seed}-{i}-"` padded with 'x' to `payload_bytes` (never truncated)."""
    return f"{seed}-{i}-".ljust(payload_bytes, "x")


def request_body(rid: str, payload: str) -> bytes:
    """The OIP v2 JSON body for one BYTES input (ids and payloads are JSON-safe by construction)."""
    return b"".join((_BODY_HEAD, rid.encode(), _BODY_MID, payload.encode(), _BODY_TAIL))


class BadAnswer(ValueError):
    """A success answer that is not a readable inference response."""


Fields = tuple[str | None, str, str, str]
"""What the check reads of an answer: (id, model_name, model_version, OUTPUT0's digest)."""

Answer = tuple[str | None, Mapping[str, str], bytes]
"""What a transport's send returns: (None on success else the error kind, the response metadata the
recorder reads, the answer's bytes)."""


class _Output(msgspec.Struct):
    data: list[Any] = []


class _InferResponse(msgspec.Struct):
    id: str | None = None
    model_name: str = ""
    model_version: str | int = "1"
    outputs: list[_Output] = []


_decode_json = msgspec.json.Decoder(_InferResponse).decode


def json_fields(raw: bytes) -> Fields:
    """The checked fields of an OIP v2 JSON answer (`BadAnswer` when it is not one)."""
    try:
        resp = _decode_json(raw)
        digest = resp.outputs[0].data[0]
    except (msgspec.DecodeError, IndexError) as exc:
        raise BadAnswer(str(exc)) from exc
    return resp.id, resp.model_name, str(resp.model_version), digest


class AnswerChecker:
    """Decides whether a success answer is ours: right id, right digest; remembers outstanding ids.
    `fields` reads the answer's wire format (`json_fields`, or the gRPC edge's protobuf)."""

    def __init__(self, fields: Callable[[bytes], Fields] = json_fields) -> None:
        self.outstanding: set[str] = set()
        self._fields = fields
        self._prefixes: dict[tuple[str, str], bytes] = {}

    def check(self, rid: str, payload: str, raw: bytes) -> str:
        """'ok', 'wrong_id', 'unknown_id' (id not outstanding), 'wrong_digest' or 'bad_response'."""
        try:
            resp_id, model, version, digest = self._fields(raw)
        except BadAnswer:
            return "bad_response"
        if resp_id != rid:
            return "wrong_id" if resp_id in self.outstanding else "unknown_id"
        try:
            expected = self._expected(model, version, payload)
        except ValueError:  # model_version is not an integer
            return "bad_response"
        return "ok" if digest == expected else "wrong_digest"

    def _expected(self, model: str, version: str, payload: str) -> str:
        prefix = self._prefixes.get((model, version))
        if prefix is None:
            prefix = f"{model}:{int(version)}:".encode()
            self._prefixes[(model, version)] = prefix
        return hashlib.sha256(prefix + payload.encode()).hexdigest()[:32]
