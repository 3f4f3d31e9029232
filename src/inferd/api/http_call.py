"""The HTTP edge's reading of a request: its headers and path, parsed once into the request's `Call`
(core/call.py) before the chain, so no layer and no handler reads a header for what the Call holds.

Every route: the path's model and version (else X-Inferd-Model-Version), X-Request-Id, the W3C trace
context (traceparent, tracestate), and, when tenants are configured, the API key (`Authorization:
Bearer KEY`, else `X-API-Key`).

The routes that run a model's work (`Hints`) also read what the caller asks of that work: X-Priority,
X-Request-Timeout-Ms and, without tenants, X-Tenant (the caller's anonymous tenant: its fairness lane
and LLM prefix-cache salt). A bad value there is a 400 naming the header, answered through the whole
chain (api/app.py `Api.endpoint`), so a call without its key still gets its 401 first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from inferd.api.asgi import HttpRequest
from inferd.api.http import header_timeout_ms, parse_priority
from inferd.core.call import Call, ErrorBody
from inferd.core.tenant import MAX_ANONYMOUS_NAME, anonymous
from inferd.errors import BadRequest
from inferd.observability.logging_setup import accept_request_id

Header = Callable[[bytes], str | None]
"""A caller's metadata value by lower-case name (None: not sent)."""


@dataclass(frozen=True, slots=True)
class Hints:
    """What a route reads of the caller's wishes for its work, besides the path and the key."""

    priority: bool = True
    """X-Priority (the body may change it)."""
    timeout: bool = True
    """X-Request-Timeout-Ms."""
    tenant: bool = True
    """X-Tenant, without tenants configured."""


MODEL_WORK = Hints()
"""A route that runs a model's work: all of them."""


def http_call(request: HttpRequest, error_body: ErrorBody, route: str, keys: bool) -> Call:
    """The Call of `request` on `route`, with what every route reads; `keys`: tenants are configured, so
    the caller's API key is read (nothing here can fail)."""
    header = request.header
    params = request.path_params
    version = params.get("version")
    traceparent = header(b"traceparent")
    return Call(
        error_body,
        request.peer,
        route,
        request.method,
        request.path,
        params.get("model"),
        version if version is not None else header(b"x-inferd-model-version"),
        accept_request_id(header(b"x-request-id")),
        traceparent,
        None if traceparent is None else header(b"tracestate"),
        presented_key(request) if keys else None,
    )


def read_hints(call: Call, request: HttpRequest, hints: Hints, keys: bool) -> None:
    """`hints` of `request` into `call`: BadRequest naming the header when one is not a valid value.
    `keys`: tenants are configured, and X-Tenant is not even read (the key names the tenant)."""
    hints_from(call, request.header, hints, keys)


def hints_from(call: Call, header: Header, hints: Hints, keys: bool) -> None:
    """`read_hints` over any edge's metadata: `header` looks a value up by lower-case name (HTTP
    headers, gRPC metadata)."""
    if hints.priority:
        value = header(b"x-priority")
        if value is not None:
            call.priority = parse_priority(None, value)
    if hints.timeout:
        value = header(b"x-request-timeout-ms")
        if value is not None:
            call.timeout_ms = header_timeout_ms(value)
    if hints.tenant and not keys:
        name = header(b"x-tenant")
        if name:
            if len(name) > MAX_ANONYMOUS_NAME:
                raise BadRequest(f"X-Tenant is {len(name)} characters long; at most {MAX_ANONYMOUS_NAME}")
            call.tenant = anonymous(name)


def presented_key(request: HttpRequest) -> str | None:
    """The key the caller sent: a Bearer credential, else X-API-Key (None: neither)."""
    return key_from(request.header)


def key_from(header: Header) -> str | None:
    """`presented_key` over any edge's metadata (`header`: a value by lower-case name)."""
    raw = None
    authorization = header(b"authorization")
    if authorization:
        scheme, _, credential = authorization.strip().partition(" ")
        if scheme.lower() == "bearer":
            raw = credential.strip()
    if not raw:
        raw = (header(b"x-api-key") or "").strip()
    if not raw:
        return None
    return raw.encode("latin-1").decode("utf-8", "surrogateescape")  # the header's bytes, as sent
