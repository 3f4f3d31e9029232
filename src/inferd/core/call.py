"""The request core under the HTTP routes and the gateway layers: a request's `Call` on its way through the
chain, the `Handler` and `Layer` types, and `chain()`. api/middleware.py holds the chain's own layers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferd.core.asgi import HttpRequest, HttpResponse, StreamingResponse
from inferd.errors import ServingError
from inferd.runtime.contract import Runtime

Response = HttpResponse | StreamingResponse
ErrorBody = Callable[[ServingError, int], bytes]


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
    notes: dict[str, Any] = field(default_factory=dict)
    """Per-call values layers hand each other (e.g. a tenant, a trace id)."""


Handler = Callable[[Call], Awaitable[Response]]
Layer = Callable[[Handler], Handler]


def chain(layers: Sequence[Layer], handler: Handler) -> Handler:
    """`layers` outermost first, around `handler`."""
    for layer in reversed(layers):
        handler = layer(handler)
    return handler
