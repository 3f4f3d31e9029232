"""Request ids, the log formatter's context fields and redaction, and the trace settings from the
OTEL_* environment and the flags."""

from __future__ import annotations

import json
import logging

import pytest

from inferd.observability.logging_setup import (
    CURRENT,
    REDACTED,
    ContextFormatter,
    Redactor,
    RequestLog,
    accept_request_id,
)
from inferd.observability.settings import ObservabilitySettings, from_environment


@pytest.mark.parametrize("value", ["abc", "A-Z.0_9:x", "x" * 128])
def test_a_well_formed_request_id_is_kept(value: str) -> None:
    assert accept_request_id(value) == value


@pytest.mark.parametrize("value", [None, "", "x" * 129, "has space", "semi;colon", "naïve", "a/b"])
def test_a_missing_or_malformed_request_id_is_replaced_by_a_new_one(value: str | None) -> None:
    made = accept_request_id(value)
    assert made != value and accept_request_id(made) == made
    assert accept_request_id(value) != made, "each replacement is new"


def record(message: str, *args: object, fields: dict | None = None) -> logging.LogRecord:
    rec = logging.LogRecord("inferd.api", logging.INFO, __file__, 1, message, args, None)
    if fields is not None:
        rec.fields = fields
    return rec


def test_lines_carry_the_requests_context_as_text_and_as_json() -> None:
    token = CURRENT.set(RequestLog("req-1", None, lambda _: ("alpha", "sim")))
    try:
        text = ContextFormatter("text", Redactor()).format(record("hello %s", "there"))
        obj = json.loads(ContextFormatter("json", Redactor()).format(record("hi", fields={"status": 200})))
    finally:
        CURRENT.reset(token)
    assert text.endswith("hello there request_id=req-1 tenant=alpha model=sim")
    assert obj["request_id"] == "req-1" and obj["tenant"] == "alpha" and obj["model"] == "sim"
    assert obj["message"] == "hi" and obj["status"] == 200 and obj["level"] == "INFO"
    outside = json.loads(ContextFormatter("json", Redactor()).format(record("no request")))
    assert "request_id" not in outside and "tenant" not in outside


def test_credentials_and_registered_secrets_are_scrubbed_from_lines() -> None:
    redact = Redactor(["join-secret-123"])
    line = redact(
        "Authorization: Bearer sk-abc.def token join-secret-123 cmd --token hunter2x and basic dXNlcg=="
    )
    assert "sk-abc.def" not in line and "join-secret-123" not in line and "hunter2x" not in line
    assert "dXNlcg==" not in line and line.count(REDACTED) == 4


def test_tracing_is_off_unless_an_exporter_or_endpoint_is_named() -> None:
    assert not from_environment({}).tracing
    assert not from_environment({"OTEL_SERVICE_NAME": "x"}).tracing
    assert not from_environment(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}
    ).tracing


def test_the_otel_environment_configures_export_and_sampling() -> None:
    s = from_environment(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
            "OTEL_SERVICE_NAME": "edge",
        }
    )
    assert (s.trace_exporter, s.trace_endpoint) == ("otlp", "http://collector:4318/v1/traces")
    assert (s.trace_sampler, s.trace_sample_ratio, s.service_name) == (
        "parentbased_traceidratio",
        0.25,
        "edge",
    )
    signal = from_environment({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:9/custom"})
    assert signal.trace_endpoint == "http://c:9/custom", "the signal's own URL is used as given"


def test_flags_win_over_the_environment_and_reach_the_workers() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318", "OTEL_TRACES_SAMPLER": "always_on"}
    s = from_environment(env, trace_endpoint="http://flag:4318", trace_sample=0.01, log_format="json")
    assert s.trace_endpoint == "http://flag:4318/v1/traces"
    assert (s.trace_sampler, s.trace_sample_ratio) == ("parentbased_traceidratio", 0.01)
    args = s.worker_args()
    assert args[:2] == ["--log-format", "json"] and "http://flag:4318/v1/traces" in args
    assert ObservabilitySettings().worker_args() == ["--log-format", "text"]
