"""HTTP helpers shared by the route modules: content type, bounded body reads, priorities, and the one
rule that makes a request's deadline. (Waiting for a batch model's results is kinds/batch/service.py's.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TypeVar

import msgspec

from inferd.api.asgi import HttpRequest, HttpResponse
from inferd.clock import Clock
from inferd.core.disconnect import ClientGone
from inferd.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from inferd.routing.fairness import BULK, INTERACTIVE, PRIORITY_NAMES

T = TypeVar("T")

JSON_TYPES = ("application/json", "application/octet-stream", "")


def parse_priority(param: object, header: str | None) -> int:
    """OIP `parameters.priority` or the X-Priority header: 'interactive' (default) or 'bulk'; Triton-style
    integers are accepted too (0 or 1: interactive, 2 and above: bulk)."""
    value = param if param is not None else header
    if value is None:
        return INTERACTIVE
    if isinstance(value, str):
        name = value.strip().lower()
        if name in PRIORITY_NAMES:
            return PRIORITY_NAMES[name]
        if name.isascii() and name.isdigit():  # '\u00b2'.isdigit(), but int() refuses it
            value = int(name)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return INTERACTIVE if value <= 1 else BULK
    raise BadRequest(
        f"priority {value!r} is not one of 'interactive', 'bulk' (or a Triton priority level >= 0)"
    )


def decode_json(decoder: msgspec.json.Decoder[T], body: bytes, what: str, empty_hint: str) -> T:
    """Decode and validate a JSON body, turning every way it can be wrong into a 400 that names it."""
    if not body:
        raise BadRequest(f"empty request body: {empty_hint}")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("JSON is nested too deeply") from None


def check_content_type(request: HttpRequest, allowed: Sequence[str] = JSON_TYPES) -> None:
    ctype = (request.header(b"content-type") or "").split(";", 1)[0].strip().lower()
    if ctype not in allowed:
        raise UnsupportedMediaType(
            f"unsupported Content-Type {ctype!r}: send application/json (or application/octet-stream with "
            "Inference-Header-Content-Length for binary tensors)"
        )


DRAIN_MIN_BYTES = 64 * 1024 * 1024
"""An over-limit body is read and dropped up to max(DRAIN_MIN_BYTES, 4 x the limit) bytes in all..."""
DRAIN_MAX_S = 1.0
"""...and for at most this long, before the 413 is sent."""


async def read_body(request: HttpRequest, limit: int) -> bytes:
    """The whole body, or PayloadTooLarge once it is known to exceed `limit`.

    Before the 413, the rest of the body is read and dropped (bounded: DRAIN_MIN_BYTES or 4 x the limit,
    and DRAIN_MAX_S), and the connection is marked to close: clients that send the whole body before
    reading (urllib, requests) then read the 413 instead of a connection reset. A body announced larger
    than that bound is refused at once, unread."""
    drain_limit = max(DRAIN_MIN_BYTES, 4 * limit)
    declared = request.header(b"content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest(f"Content-Length {declared!r} is not a number") from None
        if size > limit:
            if size <= drain_limit:
                await _drain(request, 0, drain_limit)
            raise _too_large(request, f"request body of {size} bytes exceeds the limit of {limit} bytes")
    try:
        first, more = await request.read()  # the common case: the whole body in one piece
    except ConnectionAbortedError:
        raise ClientGone() from None
    if not more:
        if len(first) > limit:
            raise _too_large(request, f"request body exceeds the limit of {limit} bytes")
        return first
    chunks: list[bytes] = [first]
    total = len(chunks[0])
    try:
        async for chunk in request.chunks():
            total += len(chunk)
            if total > limit:
                await _drain(request, total, drain_limit)
                raise _too_large(request, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ConnectionAbortedError:
        raise ClientGone() from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_head(request: HttpRequest, limit: int) -> tuple[bytes, bool]:
    """The body, or its first `limit` bytes once it is known to be longer, and whether that is all of it.
    A longer body is not kept: the rest is read and dropped as before a 413 (bounded), and the connection
    closes. For a route that says from a body's head why it refuses it (api/repository.py's load)."""
    chunks: list[bytes] = []
    total = 0
    try:
        while not request.body_ended:
            chunk, _ = await request.read()
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                if total <= max(DRAIN_MIN_BYTES, 4 * limit):
                    await _drain(request, total, max(DRAIN_MIN_BYTES, 4 * limit))
                request.close_connection = True
                return b"".join(chunks)[:limit], False
    except ConnectionAbortedError:
        raise ClientGone() from None
    return b"".join(chunks), True


async def _drain(request: HttpRequest, received: int, drain_limit: int) -> None:
    """Read and drop the rest of the body until it ends, `drain_limit` bytes were received in all, or
    DRAIN_MAX_S passed, whichever comes first (at once if the body has ended)."""
    if request.body_ended:  # the limit was crossed by the last message: nothing is left to drop
        return
    try:
        async with asyncio.timeout(DRAIN_MAX_S):
            async for chunk in request.chunks():
                received += len(chunk)
                if received > drain_limit:
                    return
    except (TimeoutError, ConnectionAbortedError):
        return


def _too_large(request: HttpRequest, message: str) -> PayloadTooLarge:
    request.close_connection = True  # whatever is left of the body is never read
    return PayloadTooLarge(message)


def json_response(
    body: bytes, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None
) -> HttpResponse:
    return HttpResponse(body, status, b"application/json", headers or [])


def header_timeout_ms(header_ms: str) -> float:
    """X-Request-Timeout-Ms as a number of milliseconds (a 400 naming it when it is not one)."""
    try:
        return float(header_ms)
    except ValueError:
        raise BadRequest(f"X-Request-Timeout-Ms must be a number of milliseconds, got {header_ms!r}") from None


def request_deadline(
    clock: Clock,
    max_timeout_ms: float,
    timeout_us: float | None,
    header_ms: float | None,
    default_ms: float | None,
    wire: float | None = None,
) -> float | None:
    """A request's absolute deadline on `clock`, the one rule of every route: the smaller of OIP
    parameters.timeout (microseconds, Triton's way) and X-Request-Timeout-Ms (`Call.timeout_ms`) when
    both are given, the one given, else `default_ms` (None: no deadline). A value given outside
    (0, max_timeout_ms] is a 400.

    `wire`: the deadline the caller's wire carries, absolute on `clock` (a gRPC deadline: the edge's
    `Call.deadline`). It is the request's deadline as a timeout given would be (no default then), the
    smaller of it and the others winning; one beyond max_timeout_ms is cut to it (clients set long
    deadlines: not a bad request)."""
    timeout_ms = None
    for given in (None if timeout_us is None else timeout_us / 1000.0, header_ms):
        if given is None:
            continue
        if not 0 < given <= max_timeout_ms:
            raise BadRequest(f"timeout of {given} ms is outside (0, {max_timeout_ms}] ms")
        timeout_ms = given if timeout_ms is None else min(timeout_ms, given)
    if timeout_ms is None and wire is None:
        timeout_ms = default_ms
    now = clock.now()
    if wire is not None:
        bound = min(wire, now + max_timeout_ms / 1000.0)
        return bound if timeout_ms is None else min(bound, now + timeout_ms / 1000.0)
    if timeout_ms is None:
        return None
    if not 0 < timeout_ms <= max_timeout_ms:
        raise BadRequest(f"timeout of {timeout_ms} ms is outside (0, {max_timeout_ms}] ms")
    return now + timeout_ms / 1000.0
