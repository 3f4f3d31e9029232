"""Distributed traces with the OpenTelemetry SDK: the spans of a request's life, front end and worker.

    inferd.request            one per HTTP request (server span); continues a caller's W3C traceparent
      inferd.queue            the request's wait in its model's queue (from enqueue to the batch cut)
      inferd.batch            one per batch: a child of the first traced request it carries, with a
                              span link to every traced request span it carries (the first included)
        inferd.worker.compute recorded and exported by the worker process itself (its own resource,
                              its own process.pid), a child of the batch through RunBatch.traceparent
      inferd.upstream         a call to an upstream model API, its traceparent sent in the call's headers
      inferd.search.embed     a search's query embedding (kinds/search/service.py), then one
      inferd.search.shard     per shard call (hedge = true on a hedge), then
      inferd.search.fuse      merging and fusing the shards' lists
    LLM requests get events on their request span: first_token, resumed (failover), finished.

Off by default and then nearly free: every hook in a hot path reads the module-level `ENABLED` first,
so nothing is imported, created or looked up unless `configure` turned tracing on. Spans are only built
for traces the sampler kept (`is_recording()`): an unsampled request costs one non-recording span.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from inferd.observability.settings import ObservabilitySettings

ENABLED = False
"""Read before any tracing work in a hot path: False costs one attribute load."""

_tracer: trace.Tracer = trace.NoOpTracer()
_provider: Any = None
_propagator = TraceContextTextMapPropagator()
_NO_SPAN = contextlib.nullcontext()
Span = trace.Span


def configure(settings: ObservabilitySettings, role: str, sampler: str | None = None) -> None:
    """Turn tracing on for this process when `settings` name an exporter. `role` (server, worker) goes
    in the resource beside service.name and process.pid; `sampler` overrides the settings' sampler (a
    worker only continues traces its front end sampled: parentbased_always_off)."""
    global ENABLED, _tracer, _provider
    if not settings.tracing:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    resource = Resource.create(
        {"service.name": settings.service_name, "process.pid": os.getpid(), "inferd.role": role}
    )
    _provider = TracerProvider(
        resource=resource, sampler=_sampler(sampler or settings.trace_sampler, settings)
    )
    exporter: SpanExporter
    if settings.trace_exporter == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=settings.trace_endpoint)
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = _provider.get_tracer("inferd")
    ENABLED = True


_ROOT_RATIO: float | None = None
"""With a ratio sampler, the share of requests that start a trace, decided by `start_request` before
any span exists: an unsampled request then costs one random draw, not a non-recording span, a context
and the sampler's own work (+22% of front-end CPU at 1% sampling when the SDK decided)."""
_ROOT_FOLLOWS_PARENT = True
"""parentbased_traceidratio: a caller's traceparent decides; traceidratio: the ratio decides always."""


def _sampler(name: str, settings: ObservabilitySettings) -> Any:
    from opentelemetry.sdk.trace import sampling

    global _ROOT_RATIO, _ROOT_FOLLOWS_PARENT
    ratio = settings.trace_sample_ratio
    if name in ("traceidratio", "parentbased_traceidratio"):  # the ratio is applied in start_request
        _ROOT_RATIO, _ROOT_FOLLOWS_PARENT = ratio, name == "parentbased_traceidratio"
        return sampling.ParentBased(sampling.ALWAYS_ON) if _ROOT_FOLLOWS_PARENT else sampling.ALWAYS_ON
    _ROOT_RATIO = None
    return {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": lambda: sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": lambda: sampling.ParentBasedTraceIdRatio(ratio),
    }[name]()


def shutdown() -> None:
    """Export what is buffered and stop (at process exit)."""
    global ENABLED, _provider
    if _provider is not None:
        _provider.shutdown()
    ENABLED, _provider = False, None


# ---- the request span (front end) ----------------------------------------------------------------------
def start_request(method: str, route: str, parent: str | None, state: str | None) -> Span | None:
    """The inferd.request span, continuing the caller's traceparent/tracestate when it sent one; None
    when the ratio sampler leaves the request out (nothing of it is traced)."""
    carrier = {}
    if (
        _ROOT_RATIO is not None
        and (parent is None or not _ROOT_FOLLOWS_PARENT)
        and random.random() >= _ROOT_RATIO  # nosec B311  # trace sampling, not secrets
    ):
        return None
    if parent is not None:
        carrier["traceparent"] = parent
        if state is not None:
            carrier["tracestate"] = state
    ctx = _propagator.extract(carrier, context=otel_context.Context())  # a root unless the caller's
    return _tracer.start_span(
        "inferd.request",
        context=ctx,
        kind=trace.SpanKind.SERVER,
        attributes={"route": route, "http.request.method": method},
    )


def enter(span: Span) -> object:
    """Make `span` the current span of this task (log lines and child spans see it); `leave` undoes it."""
    return otel_context.attach(trace.set_span_in_context(span))


def leave(token: object) -> None:
    otel_context.detach(token)  # type: ignore[arg-type]


def finish_request(span: Span, status: int, attributes: dict[str, Any]) -> None:
    """End the request span with what the chain learnt (model, version, tenant, priority, outcome)."""
    if span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(trace.StatusCode.ERROR, str(attributes.get("outcome", "")))
    span.end()


def recording_span() -> Span | None:
    """The current span if the sampler kept it (what a queued item or a token stream remembers)."""
    span = trace.get_current_span()
    return span if span.is_recording() else None


def traceparent(span: Span | None) -> str:
    """The W3C traceparent naming `span` ("" for none), for a worker message or an outgoing call."""
    if span is None:
        return ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


# ---- queue and batch (front end) -------------------------------------------------------------------
def start_batch(batch_id: int, items: Sequence[Any], worker_id: str, model: str, now: float) -> Span | None:
    """At the cut: each traced request's inferd.queue span (its wait, from enqueue to `now`, on the
    batcher's clock), and the batch's inferd.batch span linking every traced request. None when no
    item of the batch belongs to a sampled trace."""
    waits: dict[int, tuple[Span, float]] = {}
    for item in items:
        span = item.trace
        if span is not None:
            key = span.get_span_context().span_id
            if key not in waits or item.enqueued_at < waits[key][1]:
                waits[key] = (span, item.enqueued_at)
    if not waits:
        return None
    wall_ns = time.time_ns()
    for span, enqueued_at in waits.values():
        start_ns = wall_ns - int((now - enqueued_at) * 1e9)
        ctx = trace.set_span_in_context(span)
        _tracer.start_span("inferd.queue", context=ctx, start_time=start_ns).end(wall_ns)
    spans = [span for span, _ in waits.values()]
    return _tracer.start_span(
        "inferd.batch",
        context=trace.set_span_in_context(spans[0]),
        links=[trace.Link(s.get_span_context()) for s in spans],
        attributes={"batch_id": batch_id, "batch_size": len(items), "worker_id": worker_id, "model": model},
        start_time=wall_ns,
    )


def end_batch(span: Span, compute_s: float | None, error: str | None) -> None:
    """The batch came back (compute_s as the worker measured it) or was lost (`error`)."""
    if compute_s is not None:
        span.set_attribute("compute_ms", round(compute_s * 1000, 3))
    if error is not None:
        span.set_status(trace.StatusCode.ERROR, error)
    span.end()


# ---- the worker ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def worker_compute(parent: str, batch_id: int, size: int, worker_id: str) -> Iterator[Span]:
    """The worker's inferd.worker.compute span, a child of the batch span named by `parent`."""
    ctx = _propagator.extract({"traceparent": parent})
    attributes = {"batch_id": batch_id, "batch_size": size, "worker_id": worker_id}
    with _tracer.start_as_current_span("inferd.worker.compute", context=ctx, attributes=attributes) as span:
        yield span


def compute(parent: str, batch_id: int, size: int, worker_id: str) -> contextlib.AbstractContextManager[Any]:
    """`worker_compute` for a batch its front end traced; a shared no-op otherwise."""
    if not ENABLED or not parent:
        return _NO_SPAN
    return worker_compute(parent, batch_id, size, worker_id)


# ---- events, upstream calls, other components ---------------------------------------------------------
def event(span: Span | None, name: str, attributes: dict[str, Any] | None = None) -> None:
    """An event on a span that may be None (an untraced request): LLM first_token, resumed, finished."""
    if span is not None:
        span.add_event(name, attributes or {})


def stream_events(span: Span, worker_id: str, first: bool, last: bool, tokens: int) -> None:
    """A token stream's first_token and finished events (with the worker generating it)."""
    if first:
        span.add_event("first_token", {"worker_id": worker_id})
    if last:
        span.add_event("finished", {"worker_id": worker_id, "completion_tokens": tokens})


@contextlib.contextmanager
def _client_span(name: str, headers: dict[str, str], attributes: dict[str, Any]) -> Iterator[dict[str, str]]:
    with _tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT, attributes=attributes) as span:
        if not span.is_recording():
            yield headers
            return
        headers = dict(headers)
        _propagator.inject(headers)
        yield headers


def upstream(
    model: str, url: str, headers: dict[str, str]
) -> contextlib.AbstractContextManager[dict[str, str]]:
    """An inferd.upstream span around one call to an upstream model API (until its answer's head);
    yields the headers to send: `headers`, plus the span's traceparent (and tracestate) when the trace
    is sampled, so the upstream continues it. `headers` itself is never changed."""
    if not ENABLED:
        return contextlib.nullcontext(headers)
    return _client_span("inferd.upstream", headers, {"model": model, "url.full": url})


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span named `name` (e.g. inferd.search) as a child of the current one, for components that
    want their own; a shared no-op when tracing is off. Use `with tracing.span(...) as s:` (s may be None)."""
    if not ENABLED:
        return _NO_SPAN
    return _tracer.start_as_current_span(name, attributes=attributes)


def start_span(name: str, **attributes: Any) -> Span | None:
    """A span named `name`, a child of the current one, that the caller ends itself (`end_span`): for
    work that does not fit one `with` block (a shard call answered in a wait loop). None when tracing
    is off or the trace is not sampled."""
    if not ENABLED:
        return None
    span = _tracer.start_span(name, attributes=attributes)
    if span.is_recording():
        return span
    span.end()
    return None


def end_span(span: Span | None, **attributes: Any) -> None:
    """End a `start_span` span (None: nothing to do), with these attributes added."""
    if span is not None:
        span.set_attributes(attributes)
        span.end()


def log_ids() -> tuple[str, str] | None:
    """The current span's (trace_id, span_id) in hex, for log lines; None when there is none."""
    if not ENABLED:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
