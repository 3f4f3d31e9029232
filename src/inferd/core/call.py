"""The request core under the HTTP routes and the gateway layers: a request's `Call` on its way through the
chain, the `Handler` and `Layer` types, and `chain()`. api/middleware.py holds the chain's own layers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from inferd.core.asgi import HttpRequest, HttpResponse, StreamingResponse
from inferd.core.tenant import Tenant
from inferd.errors import ServingError
from inferd.routing.fairness import INTERACTIVE
from inferd.runtime.contract import Runtime

Response = HttpResponse | StreamingResponse
ErrorBody = Callable[[ServingError, int], bytes]


class TokenAdmission(Protocol):
    """A limited tenant's admission on a token route (gateway/quota_layer.py's `QuotaTicket`): taken
    once the handler knows the tokens it will generate; `used` counts what it really used, for the
    refund."""

    async def reserve(self, tokens: int, used: Callable[[], int | None]) -> None: ...


@dataclass(slots=True)
class Call:
    """One HTTP request on its way through the chain, and what the layers learn about it."""

    request: HttpRequest
    error_body: ErrorBody
    """How this route's API spells an error (OIP's {"error": ...}, OpenAI's error object)."""
    runtime: Runtime | None = None
    """The model version serving the call, once the handler has resolved it."""
    outcome: str = "ok"
    started_at: float = 0.0
    route: str = ""
    """The route's path template (e.g. /v2/models/{model}/infer)."""
    request_id: str = ""
    """X-Request-Id: the caller's if it is well-formed, else one made up (api/request_context.py)."""
    tenant: Tenant | None = None
    """The authenticated caller, set by the Auth layer (None: no tenants configured, or an open route)."""
    quota: TokenAdmission | None = None
    """The Quotas layer's admission of a limited tenant's call, for a token route's handler to take."""
    priority: int = INTERACTIVE
    """The call's priority class (routing/fairness.py), once the handler has parsed the request."""
    deadline: float | None = None
    """When the call must be answered, absolute on the server's clock (None: no deadline), once the
    handler has parsed the request."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Per-call values layers hand each other (the refusal reason for accounting, the cache result)."""


Handler = Callable[[Call], Awaitable[Response]]
Layer = Callable[[Handler], Handler]


def chain(layers: Sequence[Layer], handler: Handler) -> Handler:
    """`layers` outermost first, around `handler`."""
    for layer in reversed(layers):
        handler = layer(handler)
    return handler
