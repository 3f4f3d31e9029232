"""The log and trace flags of `inferd serve` and `inferd worker`, and the process setup they drive."""

from __future__ import annotations

import os
from typing import Annotated

import typer
from pydantic import ValidationError

from inferd.config import ConfigError, describe_validation_error
from inferd.observability.settings import ObservabilitySettings, from_environment

LogFormat = Annotated[
    str | None, typer.Option(help="Log lines as text or json (one object per line) (default: text).")
]
AccessLogSample = Annotated[
    float | None,
    typer.Option(
        help="Share of requests (0..1) the access log writes a line for; turns the access log on "
        "unless --no-access-log (default: 1)."
    ),
]
TraceEndpoint = Annotated[
    str | None,
    typer.Option(
        help="Export OpenTelemetry traces over OTLP/HTTP to this collector (http://HOST:4318, or its "
        "/v1/traces URL) (default: OTEL_EXPORTER_OTLP_ENDPOINT; none: tracing off)."
    ),
]
TraceSample = Annotated[
    float | None,
    typer.Option(
        help="Share of traces (0..1) started here that are recorded; a caller's sampled traceparent is "
        "always continued (default: OTEL_TRACES_SAMPLER(_ARG), else 1)."
    ),
]


def observability_settings(
    log_format: str | None,
    access_log_sample: float | None = None,
    trace_endpoint: str | None = None,
    trace_sample: float | None = None,
    service_name: str | None = None,
) -> ObservabilitySettings:
    """The flags over the OTEL_* environment; ConfigError naming the bad value."""
    try:
        return from_environment(
            os.environ,
            log_format=log_format,
            access_log_sample=access_log_sample,
            trace_endpoint=trace_endpoint,
            trace_sample=trace_sample,
            service_name=service_name,
        )
    except ValidationError as exc:
        raise ConfigError(describe_validation_error("log/trace settings", exc)) from None
