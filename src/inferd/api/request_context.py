"""The first layer of the chain: who a request is, for the logs, the traces and the caller.

- X-Request-Id: the caller's when it is 1..128 characters of [A-Za-z0-9._:-], else a new one; returned
  on every response, and named in every error body (api/errors: `request_id`).
- The log context (observability/logging_setup.RequestLog): every line written for the request carries
  its request_id, tenant and model (and trace_id, span_id).
- With tracing on, the inferd.request span (continuing the caller's traceparent), current while the
  request is handled and ended when its response (or its stream) ends.
"""

from __future__ import annotations

import contextlib
from functools import partial

from inferd.api.asgi import StreamingResponse
from inferd.api.middleware import Call, Handler, Response
from inferd.observability import tracing
from inferd.observability.logging_setup import CURRENT, RequestLog, accept_request_id


def describe(call: Call) -> tuple[str | None, str | None]:
    """(tenant, model) of the call, once known."""
    tenant = call.notes.get("tenant")
    rt = call.runtime
    return (tenant.name if tenant is not None else None), (rt.name if rt is not None else None)


class RequestContext:
    def __init__(self, inner: Handler) -> None:
        self.inner = inner

    async def __call__(self, call: Call) -> Response:
        request = call.request
        call.request_id = request_id = accept_request_id(request.header(b"x-request-id"))
        log_token = CURRENT.set(RequestLog(request_id, partial(describe, call)))
        span = tracing.start_request(request.method, call.route, request.header) if tracing.ENABLED else None
        span_token = tracing.enter(span) if span is not None else None
        try:
            response = await self.inner(call)
        except BaseException:
            self._done(call, span, 499, log_token, span_token)
            raise
        response.headers.append((b"x-request-id", request_id.encode()))
        done = partial(self._done, call, span, response.status, log_token, span_token)
        if isinstance(response, StreamingResponse):
            response.on_close(done)
        else:
            done()
        return response

    @staticmethod
    def _done(
        call: Call, span: tracing.Span | None, status: int, log_token: object, span_token: object
    ) -> None:
        if span is not None:
            tenant, model = describe(call)
            rt = call.runtime
            attributes = {
                "model": model,
                "version": rt.version if rt is not None else None,
                "tenant": tenant,
                "priority": call.request.header(b"x-priority") or "interactive",
                "outcome": call.outcome,
                "request_id": call.request_id,
            }
            tracing.finish_request(span, status, attributes)
            with contextlib.suppress(ValueError):  # a stream's end runs in the request's own task
                tracing.leave(span_token)
        with contextlib.suppress(ValueError):
            CURRENT.reset(log_token)  # type: ignore[arg-type]
