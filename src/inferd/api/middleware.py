"""The one request middleware chain every route passes through.

A layer is a small class holding `inner` (the rest of the chain) that does its work around
`await self.inner(call, request)` (`request`: the edge's own, passed along unread; a layer reads the
Call, which the edge filled once: api/http_call.py). `app.py` declares the chain as a list, outermost
first, and logs it at start:

    request_context -> access_log -> accounting -> tenant_requests -> model_version -> cache_result
        -> errors -> auth -> quotas -> route handler

The first layer (api/request_context.py) gives the call its log context and its trace span. A
handler records the model version that serves the call in `call.runtime` as soon as it knows it (OIP
routes from the path, OpenAI routes from the body), so accounting counts every request of every kind.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from inferd.api.asgi import HttpResponse, Response
from inferd.api.errors import error_headers, status_of
from inferd.api.http import ClientGone, json_response
from inferd.clock import Clock
from inferd.core.call import Call, Handler
from inferd.errors import Internal, Overloaded, ServingError
from inferd.observability.metrics import Metrics
from inferd.runtime.contract import Runtime

log = logging.getLogger("inferd.api")
access_log = logging.getLogger("inferd.access")


def record_stream_error(call: Call, exc: ServingError) -> None:
    """A stream ended with an error event after its response began (a deadline, a worker lost): the call
    is accounted with that error's outcome, not as ok."""
    call.outcome = status_of(exc)[1]


def refused(call: Call, exc: ServingError) -> int:
    """The call ends with `exc`: its outcome (and, for a refusal, the reason accounting counts) recorded
    on the call; returns the error's HTTP status (an edge's error layer: this one, grpc_edge/errors.py)."""
    status, call.outcome = status_of(exc)
    if isinstance(exc, Overloaded) or status == 429:
        call.notes["rejected"] = getattr(exc, "reason", "rate_limited")
    return status


def internal(call: Call, exc: Exception) -> Internal:
    """An unexpected error, logged with its traceback under an id; the caller gets the id, never the
    traceback."""
    error_id = f"{id(exc):x}"
    log.exception("internal error %s on %s %s", error_id, call.method, call.target)
    call.outcome = "internal"
    return Internal(f"internal error (id {error_id})")


class Errors:
    """Errors become responses: a ServingError gets its status and the route's error body; a client that
    went away gets 499; anything else a 500 with an id the caller can quote (never a traceback)."""

    def __init__(self, inner: Handler) -> None:
        self.inner = inner

    async def __call__(self, call: Call, request: object) -> Response:
        try:
            return await self.inner(call, request)
        except ServingError as exc:
            status = refused(call, exc)
            return json_response(call.error_body(exc, status), status, error_headers(exc))
        except ClientGone:
            call.outcome = "cancelled"
            return HttpResponse(status=499, content_type=None)
        except Exception as exc:
            return json_response(call.error_body(internal(call, exc), 500), 500)


class Accounting:
    """Every request of every route and kind in the same counters and duration histograms, labelled by
    the model and version that served it; refusals also by reason. A stream is counted when it ends,
    with the outcome its handler recorded (e.g. a deadline that cut it)."""

    def __init__(
        self,
        inner: Handler,
        metrics: Metrics,
        clock: Clock,
        observe: Callable[[Runtime, str, float], None] | None = None,
    ) -> None:
        self.inner = inner
        self.metrics = metrics
        self.clock = clock
        self.observe = observe
        """Also told each call's version, outcome and latency (the traffic splits' canary judge)."""

    async def __call__(self, call: Call, request: object) -> Response:
        call.started_at = self.clock.now()
        try:
            response = await self.inner(call, request)
        except asyncio.CancelledError:  # the edge cancelled the call (a gRPC client left): counted, as a 499 is
            call.outcome = "cancelled"
            self._count(call)
            raise
        if response.streamed:
            response.on_close(lambda: self._count(call))
        else:
            self._count(call)
        return response

    def _count(self, call: Call) -> None:
        rt = call.runtime
        if rt is None:  # refused before a model was known (bad route, unknown model): no model label
            return
        latency_s = self.clock.now() - call.started_at
        requests = self.metrics.requests_for(rt.name, rt.version, call.protocol)
        requests.observe(call.outcome, latency_s)
        self.metrics.slo.request(rt.name, call.outcome, call.notes.get("rejected"), latency_s)
        if self.observe is not None:
            self.observe(rt, call.outcome, latency_s)
        if "rejected" in call.notes:
            requests.rejected(call.notes["rejected"])


class ModelVersion:
    """Every response of a model says which model and version answered: X-Inferd-Model and
    X-Inferd-Model-Version (OIP bodies also carry model_version)."""

    def __init__(self, inner: Handler) -> None:
        self.inner = inner

    async def __call__(self, call: Call, request: object) -> Response:
        response = await self.inner(call, request)
        rt = call.runtime
        if rt is not None and response.header(b"x-inferd-model-version") is None:
            response.headers.append((b"x-inferd-model-version", str(rt.version).encode()))
        if rt is not None and response.header(b"x-inferd-model") is None:
            response.headers.append((b"x-inferd-model", rt.name.encode()))
        return response


class AccessLog:
    """One line per request (a sampled share of them) with its outcome and lifecycle record: queue wait,
    batch id and size, compute time, attempts (the X-Inferd-* headers). Off by default: costly at high
    rates. JSON logs carry its fields as keys (`fields`)."""

    def __init__(self, inner: Handler, clock: Clock, sample: float = 1.0) -> None:
        self.inner = inner
        self.clock = clock
        self.sample = sample

    async def __call__(self, call: Call, request: object) -> Response:
        start = self.clock.now()
        response = await self.inner(call, request)
        if self.sample < 1.0 and random.random() >= self.sample:  # nosec B311  # log sampling, not secrets
            return response

        def h(name: bytes) -> str:
            value = response.header(name)
            return value.decode() if value else "-"

        rt = call.runtime
        fields = {
            "method": call.method,
            "path": call.target,
            "status": response.status,
            "outcome": call.outcome,
            "model_version": f"{rt.name}:{rt.version}" if rt is not None else "-",
            "ms": round((self.clock.now() - start) * 1000, 3),
            "queue_ms": h(b"x-inferd-queue-ms"),
            "batch_id": h(b"x-inferd-batch-id"),
            "batch_size": h(b"x-inferd-batch-size"),
            "compute_ms": h(b"x-inferd-compute-ms"),
            "attempts": h(b"x-inferd-attempts"),
        }
        access_log.info(
            "%s %s status=%d outcome=%s model=%s ms=%.2f queue_ms=%s batch_id=%s batch_size=%s "
            "compute_ms=%s attempts=%s",
            *fields.values(),
            extra={"fields": {**fields, "protocol": call.protocol}},
        )
        return response
