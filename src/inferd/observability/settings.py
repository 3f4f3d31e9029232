"""Settings of logs and traces, shared by `inferd serve` and its workers.

Tracing follows the OpenTelemetry environment (OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG, OTEL_SERVICE_NAME); the
command-line flags (--trace-endpoint, --trace-sample) win over it. Unlike the SDK's own default, tracing
is off unless an exporter or an endpoint is named, so a server never sends spans nobody asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
Sampler = Literal[
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
]
TRACES_PATH = "/v1/traces"


class ObservabilitySettings(BaseModel):
    """How a process writes its logs and exports its spans."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    log_format: Literal["text", "json"] = "text"
    """text: one human-readable line per record; json: one JSON object per line."""
    access_log_sample: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of requests the access log (when on) writes a line for."""
    trace_exporter: Literal["none", "otlp", "console"] = "none"
    """Where spans go: none (tracing off), otlp (OTLP/HTTP protobuf to trace_endpoint), console (stdout)."""
    trace_endpoint: str = "http://localhost:4318" + TRACES_PATH
    """The OTLP/HTTP traces URL (a base URL given on the command line gets /v1/traces appended)."""
    trace_sampler: Sampler = "parentbased_always_on"
    """The head sampler, named as OTEL_TRACES_SAMPLER names it; a caller's sampled traceparent is
    continued with the parentbased_* samplers."""
    trace_sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    """The ratio of the *traceidratio samplers (OTEL_TRACES_SAMPLER_ARG, --trace-sample)."""
    service_name: str = "inferd"
    """The service.name of the spans' resource (OTEL_SERVICE_NAME)."""

    @property
    def tracing(self) -> bool:
        return self.trace_exporter != "none"

    def worker_args(self) -> list[str]:
        """`inferd.worker.main` arguments that give a worker the same log format and trace export (a
        worker records spans only inside traces its front end sampled)."""
        args = ["--log-format", self.log_format]
        if self.trace_exporter == "otlp":
            args += ["--trace-endpoint", self.trace_endpoint, "--service-name", self.service_name]
        return args


def traces_url(endpoint: str) -> str:
    """A collector's base URL (http://host:4318) or its traces URL -> the traces URL."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def from_environment(
    environ: Mapping[str, str],
    *,
    log_format: str | None = None,
    access_log_sample: float | None = None,
    trace_endpoint: str | None = None,
    trace_sample: float | None = None,
    service_name: str | None = None,
) -> ObservabilitySettings:
    """The OTEL_* environment, overridden by the flags that are given (None: not given)."""
    values: dict[str, object] = {}
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").split(",")[0].strip().lower()
    signal_url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base_url = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if signal_url:
        values["trace_endpoint"] = signal_url  # the signal's own URL is used as given (the spec's rule)
    elif base_url:
        values["trace_endpoint"] = traces_url(base_url)
    if exporter in ("otlp", "console", "none"):
        values["trace_exporter"] = exporter
    elif signal_url or base_url:
        values["trace_exporter"] = "otlp"
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler in SAMPLERS:
        values["trace_sampler"] = sampler
    ratio = environ.get("OTEL_TRACES_SAMPLER_ARG")
    if ratio and sampler.endswith("traceidratio"):
        values["trace_sample_ratio"] = ratio
    if environ.get("OTEL_SERVICE_NAME"):
        values["service_name"] = environ["OTEL_SERVICE_NAME"]
    if trace_endpoint:
        values["trace_endpoint"] = traces_url(trace_endpoint)
        values["trace_exporter"] = "otlp"
    if trace_sample is not None:
        values["trace_sampler"] = "parentbased_traceidratio"
        values["trace_sample_ratio"] = trace_sample
    if service_name:
        values["service_name"] = service_name
    if log_format is not None:
        values["log_format"] = log_format
    if access_log_sample is not None:
        values["access_log_sample"] = access_log_sample
    return ObservabilitySettings(**values)  # type: ignore[arg-type]
