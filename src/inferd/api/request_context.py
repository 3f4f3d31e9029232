"""The first layer of the chain: who a request is, for the logs, the traces and the caller. It reads
the Call, never the request: the edge has read the headers (api/http_call.py).

- The request id (`call.request_id`: the caller's X-Request-Id when it is 1..128 characters of
  [A-Za-z0-9._:-], else a new one): returned on every response, and named in every error body.
- The log context (observability/logging_setup.RequestLog): every line written for the request carries
  its request_id, tenant and model (and trace_id, span_id).
- With tracing on, the inferd.request span (continuing the caller's trace context,
  `call.traceparent` and `call.tracestate`), current while the request is handled and ended when its
  response (or its stream) ends.

Tracing off, a request pays a request id, a contextvar set and reset, and one header.
"""

from __future__ import annotations

import contextlib
from functools import partial

from inferd.api.asgi import Response
from inferd.core.call import Call, Handler
from inferd.observability import tracing
from inferd.observability.logging_setup import CURRENT, RequestLog
from inferd.routing.fairness import BULK


def describe(call: Call) -> tuple[str | None, str | None]:
    """(tenant, model) of the call, once known (an anonymous caller has no tenant here)."""
    tenant = call.tenant
    rt = call.runtime
    return (None if tenant.anonymous else tenant.name), (rt.name if rt is not None else None)


def _leave(log_token: object, span_token: object | None = None) -> None:
    """Restore the task's context (a stream's end runs in the request's own task)."""
    with contextlib.suppress(ValueError):
        if span_token is not None:
            tracing.leave(span_token)
        CURRENT.reset(log_token)  # type: ignore[arg-type]


class RequestContext:
    def __init__(self, inner: Handler) -> None:
        self.inner = inner

    async def __call__(self, call: Call, request: object) -> Response:
        log_token = CURRENT.set(RequestLog(call.request_id, call, describe, call.protocol))
        if tracing.ENABLED:
            return await self._traced(call, request, log_token)
        return await self._untraced(call, request, log_token)

    async def _untraced(self, call: Call, request: object, log_token: object) -> Response:
        try:
            response = await self.inner(call, request)
        except BaseException:
            CURRENT.reset(log_token)  # type: ignore[arg-type]
            raise
        response.headers.append((b"x-request-id", call.request_id.encode()))
        if response.streamed:
            response.on_close(partial(_leave, log_token))
        else:
            CURRENT.reset(log_token)  # type: ignore[arg-type]
        return response

    async def _traced(self, call: Call, request: object, log_token: object) -> Response:
        span = tracing.start_request(call.method, call.route, call.traceparent, call.tracestate)
        if span is None:  # left out by the sampler: served as if tracing were off
            return await self._untraced(call, request, log_token)
        span_token = tracing.enter(span)
        try:
            response = await self.inner(call, request)
        except BaseException:
            self._finish(call, span, 499)
            _leave(log_token, span_token)
            raise
        response.headers.append((b"x-request-id", call.request_id.encode()))
        if response.streamed:
            response.on_close(partial(self._finish, call, span, response.status))
            response.on_close(partial(_leave, log_token, span_token))
        else:
            self._finish(call, span, response.status)
            _leave(log_token, span_token)
        return response

    @staticmethod
    def _finish(call: Call, span: tracing.Span, status: int) -> None:
        tenant, model = describe(call)
        rt = call.runtime
        attributes = {
            "route": call.route,
            "model": model,
            "version": rt.version if rt is not None else None,
            "tenant": tenant,
            "priority": "bulk" if call.priority == BULK else "interactive",
            "outcome": call.outcome,
            "request_id": call.request_id,
            "protocol": call.protocol,
        }
        tracing.finish_request(span, status, attributes)
