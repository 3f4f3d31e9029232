"""The gRPC edge's reading of a call: its metadata and deadline, read once into the request's `Call`
(core/call.py) before the chain, as api/http_call.py reads an HTTP request's headers.

Every RPC: X-Request-Id, the W3C trace context (traceparent, tracestate) and, when tenants are
configured, the API key (`authorization: Bearer KEY`, else `x-api-key`). The RPCs that run a model's
work also read x-priority, x-request-timeout-ms and, without tenants, x-tenant (`read_hints`, the same
rules and messages as HTTP's), and the gRPC deadline: the call's `deadline` (absolute on the server's
clock), which the handler makes the smaller of it and the request's own timeouts, cut to the model's
max_timeout_ms (api/http.py `request_deadline`); one already past is DEADLINE_EXCEEDED. A bad value is
answered through the whole chain, so a call without its key still gets UNAUTHENTICATED first.

A caller that leaves needs no watching (the call's `departure` is core/disconnect.py's STAYING): when
the client cancels, its deadline passes or its connection closes, grpc.aio cancels the RPC's task, and
that cancellation withdraws its queued items (kinds/batch/service.py) as an HTTP disconnect does; the
Accounting layer counts the call "cancelled", as REST's 499.
"""

from __future__ import annotations

from typing import Any

from grpc import aio

from inferd.api.http_call import MODEL_WORK, hints_from, key_from
from inferd.clock import Clock
from inferd.core.call import Call
from inferd.core.disconnect import STAYING
from inferd.errors import DeadlineExceeded, ServingError
from inferd.observability.logging_setup import accept_request_id

SERVICE = "/inference.GRPCInferenceService/"
"""The prefix of every route (a gRPC method's full name) of Triton's inference service."""

_READ = frozenset(
    {
        "x-request-id",
        "traceparent",
        "tracestate",
        "authorization",
        "x-api-key",
        "x-priority",
        "x-request-timeout-ms",
        "x-tenant",
    }
)
"""The metadata the edge reads; the rest (user-agent, grpc-accept-encoding...) is passed over."""
_NONE: dict[str, str] = {}


class RpcMetadata:
    """A call's metadata by lower-case name (api/http_call.py's `Header`): what the edge reads is
    picked out in one pass (`found`: usually nothing, tritonclient sends none of it); any other name
    (an A/B split's `header:NAME`) is looked up in the pairs as sent."""

    __slots__ = ("found", "pairs")

    def __init__(self, pairs: Any) -> None:
        self.pairs = pairs or ()
        self.found = {k: v for k, v in pairs if k in _READ} if pairs else _NONE

    def get(self, name: bytes) -> str | None:
        key = name.decode("ascii")
        if key in _READ:
            return self.found.get(key)
        value = None
        for k, v in self.pairs:
            if k == key and isinstance(v, str):
                value = v  # the last one wins, as with HTTP headers
        return value


def _error_body(exc: ServingError, status: int) -> bytes:
    """An error's body, for what asks the call for one: over gRPC, its details are the message."""
    return exc.message.encode()


def grpc_call(
    context: aio.ServicerContext[Any, Any],
    metadata: RpcMetadata,
    route: str,
    model: str | None,
    version: str | None,
    keys: bool,
) -> Call:
    """The Call of an RPC on `route` (its method's full name) for `model` at `version` ("" or None: the
    default), with what every RPC reads; `keys`: tenants are configured, so the caller's API key is read
    (nothing here can fail)."""
    found = metadata.found
    traceparent = found.get("traceparent")
    call = Call(
        _error_body,
        STAYING,
        route,
        "POST",
        route,
        model or None,
        version or None,
        accept_request_id(found.get("x-request-id")),
        traceparent,
        None if traceparent is None else found.get("tracestate"),
        key_from(metadata.get) if keys and found else None,
    )
    call.protocol = "grpc"
    return call


def read_hints(
    call: Call, metadata: RpcMetadata, context: aio.ServicerContext[Any, Any], clock: Clock, keys: bool
) -> None:
    """What a model's work reads of the call: x-priority, x-request-timeout-ms, x-tenant (without
    tenants: `keys` false), as HTTP reads them, and the gRPC deadline (`call.deadline`). BadRequest
    naming the metadata when one is not a valid value; DeadlineExceeded when the deadline has passed."""
    if metadata.found:
        hints_from(call, metadata.get, MODEL_WORK, keys)
    left_s = context.time_remaining()
    if left_s is not None:
        if left_s <= 0:
            raise DeadlineExceeded("the call's gRPC deadline had passed when it arrived")
        call.deadline = clock.now() + left_s
