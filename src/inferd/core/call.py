"""The request core under the edges (api/: HTTP) and the gateway's layers: a request's `Call` on its way
through the chain, the `Reply` a chain returns, the `Handler` and `Layer` types, and `chain()`.

Nothing here knows a wire. Each edge parses its wire format once into a Call (the HTTP edge:
api/http_call.py) and hands the chain the Call and its own request, which the layers pass along
untouched: only the edge's handler reads it (for the body, after the precheck). api/middleware.py holds
the HTTP edge's own layers, gateway/ the layers that know no edge (auth, quotas).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from inferd.core.disconnect import Departure
from inferd.core.tenant import ANONYMOUS, Tenant
from inferd.errors import ServingError
from inferd.routing.fairness import INTERACTIVE
from inferd.runtime.contract import Runtime

ErrorBody = Callable[[ServingError, int], bytes]


class Reply(Protocol):
    """What a chain returns, whatever the wire: its metadata, and when it ends."""

    @property
    def metadata(self) -> list[tuple[bytes, bytes]]:
        """The reply's metadata as (name, value) pairs, which layers may extend: HTTP headers, gRPC
        metadata."""
        ...

    @property
    def streamed(self) -> bool:
        """True: the reply goes on after the chain has returned it (a stream), and `on_close` callbacks
        run at its end; False: it has ended when it is returned."""
        ...

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run `callback` once a streamed reply has ended, however it ended."""
        ...


class TokenAdmission(Protocol):
    """A limited tenant's admission on a token route (gateway/quota_layer.py's `QuotaTicket`): taken
    once the handler knows the tokens it will generate; `used` counts what it really used, for the
    refund."""

    async def reserve(self, tokens: int, used: Callable[[], int | None]) -> None: ...


@dataclass(slots=True)
class Call:
    """One request on its way through the chain: what the edge read of it, and what the layers learn."""

    error_body: ErrorBody
    """How this route's API spells an error (OIP's {"error": ...}, OpenAI's error object)."""
    departure: Departure
    """The edge's hook on the caller: `until_disconnect(call.departure, work)` stops waiting when it
    leaves."""
    route: str = ""
    """The route's template (e.g. /v2/models/{model}/infer)."""
    method: str = ""
    """The operation the caller asked for (an HTTP method)."""
    target: str = ""
    """What the caller addressed (an HTTP path), for the logs."""
    model: str | None = None
    """The model the route names (None: the body names it, or the route serves no model)."""
    version: str | None = None
    """The model version asked for (None: the default, or a traffic split's choice)."""
    request_id: str = ""
    """The caller's request id if it is well-formed, else one made up (observability/logging_setup.py)."""
    traceparent: str | None = None
    """The caller's W3C trace context (traceparent, tracestate), continued by the request span."""
    tracestate: str | None = None
    credential: str | None = None
    """The API key the caller presented (None: none), for the Auth layer. Never logged."""
    tenant: Tenant = ANONYMOUS
    """The caller (core/tenant.py): the edge's anonymous tenant, replaced by the Auth layer with the
    authenticated one when tenants are configured."""
    priority: int = INTERACTIVE
    """The call's priority class (routing/fairness.py): the edge's, which a request body may change."""
    timeout_ms: float | None = None
    """The time the caller allows, as the edge read it (an HTTP edge: X-Request-Timeout-Ms); the
    handler turns it into `deadline` once the model (and its bounds) is known."""
    deadline: float | None = None
    """When the call must be answered, absolute on the server's clock (None: no deadline), once the
    handler has parsed the request. An edge whose wire carries a deadline (gRPC) sets it before the
    chain; the handler then takes the smaller of it and the request's own (api/http.py
    `request_deadline`)."""
    protocol: str = "http"
    """The edge the call came by: "http" or "grpc" (a label of the request metrics, spans and logs)."""
    runtime: Runtime | None = None
    """The model version serving the call, once the handler has resolved it."""
    outcome: str = "ok"
    started_at: float = 0.0
    quota: TokenAdmission | None = None
    """The Quotas layer's admission of a limited tenant's call, for a token route's handler to take."""
    reserves_tokens: bool = False
    """The handler takes the call's admission itself once it knows the tokens it will generate
    (`quota.reserve`), as on the token routes: an LLM's request on another route (gRPC's ModelInfer)."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Per-call values layers hand each other (the refusal reason for accounting, the cache result)."""


Handler = Callable[[Call, Any], Awaitable[Any]]
"""A service: the Call and the edge's own request (passed along untouched by every layer; only the
edge's handler reads it), answering a `Reply` (the edge's own kind of reply)."""
Layer = Callable[[Handler], Handler]


def chain(layers: Sequence[Layer], handler: Handler) -> Handler:
    """`layers` outermost first, around `handler`."""
    for layer in reversed(layers):
        handler = layer(handler)
    return handler
