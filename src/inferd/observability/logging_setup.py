"""Log lines that say which request they belong to, as text or as JSON, with secrets kept out.

Every record written while a request is handled carries its request_id, its trace_id and span_id (when
tracing is on) and its tenant and model (once known), read from contextvars: the request's
`RequestLog` (set by the API's first layer) and OpenTelemetry's current span. Lines are scrubbed of
bearer credentials and of every secret value registered with `configure_logging` (join and admin tokens).
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

from inferd.observability import tracing
from inferd.observability.settings import ObservabilitySettings

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_BEARER_RE = re.compile(r"(?i)\b(bearer|basic)\s+[^\s\"',;]+")
_TOKEN_ARG_RE = re.compile(r"(--token[ =])\S+")
REDACTED = "[redacted]"


class RequestLog:
    """The request a task is working for, as its log lines name it. `describe(source)` reads the tenant
    and the model lazily: they are learnt (authentication, model resolution) after its first line."""

    __slots__ = ("describe", "protocol", "request_id", "source")

    def __init__(
        self,
        request_id: str,
        source: Any,
        describe: Callable[[Any], tuple[str | None, str | None]],
        protocol: str = "http",
    ) -> None:
        self.request_id = request_id
        self.source = source
        self.describe = describe
        self.protocol = protocol
        """The edge the request came by: lines name it when it is not HTTP (protocol=grpc)."""


CURRENT: ContextVar[RequestLog | None] = ContextVar("inferd_request_log", default=None)


_ID_PREFIX = secrets.token_hex(8)
_id_counter = itertools.count(1)


def accept_request_id(value: str | None) -> str:
    """The caller's X-Request-Id when it is 1..128 characters of [A-Za-z0-9._:-]; else a new one (a
    random per-process prefix and a counter: unique, and cheaper than fresh randomness per request)."""
    if value is not None and REQUEST_ID_RE.fullmatch(value):
        return value
    return f"{_ID_PREFIX}{next(_id_counter):08x}"


def current_request_id() -> str | None:
    """The request id of the request this task is handling (None outside one)."""
    entry = CURRENT.get()
    return None if entry is None else entry.request_id


def context_fields() -> dict[str, str]:
    """request_id, trace_id, span_id, tenant, model and protocol (when not http), those that apply here."""
    fields: dict[str, str] = {}
    entry = CURRENT.get()
    if entry is not None:
        fields["request_id"] = entry.request_id
    ids = tracing.log_ids()
    if ids is not None:
        fields["trace_id"], fields["span_id"] = ids
    if entry is not None:
        tenant, model = entry.describe(entry.source)
        if tenant is not None:
            fields["tenant"] = tenant
        if model is not None:
            fields["model"] = model
        if entry.protocol != "http":
            fields["protocol"] = entry.protocol
    return fields


class Redactor:
    """Replaces credentials in a finished line: bearer/basic credentials, a --token argument, and
    every registered secret value."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        self.values = sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)

    def __call__(self, line: str) -> str:
        line = _BEARER_RE.sub(lambda m: f"{m.group(1)} {REDACTED}", line)
        line = _TOKEN_ARG_RE.sub(lambda m: m.group(1) + REDACTED, line)
        for value in self.values:
            if value in line:
                line = line.replace(value, REDACTED)
        return line


class ContextFormatter(logging.Formatter):
    """text: the classic line, then key=value for the request's context fields; json: one object per
    line with those keys, and the keys of the record's `fields` extra (the access log's)."""

    def __init__(self, fmt: str, redact: Redactor) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
        self.json = fmt == "json"
        self.redact = redact

    def format(self, record: logging.LogRecord) -> str:
        fields = context_fields()
        extra: dict[str, Any] | None = getattr(record, "fields", None)
        if self.json:
            line = json.dumps(self._object(record, fields, extra), default=str, separators=(",", ":"))
        else:
            line = super().format(record)
            if fields:
                line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return self.redact(line)

    def _object(
        self, record: logging.LogRecord, fields: dict[str, str], extra: dict[str, Any] | None
    ) -> dict[str, Any]:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        obj: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
            **fields,
        }
        if extra:
            obj.update(extra)
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return obj


def configure_logging(level: str, fmt: str, secret_values: Iterable[str] = ()) -> None:
    """The root logger writes to stderr at `level`, as `fmt` (text or json), scrubbing `secret_values`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ContextFormatter(fmt, Redactor(secret_values)))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def set_up_process(
    settings: ObservabilitySettings, level: str, role: str, secret_values: Iterable[str] = ()
) -> None:
    """Logging (format, level, `secret_values` scrubbed) and tracing (flushed at exit) of this process.
    A worker (`role`) records spans only inside traces its front end sampled."""
    configure_logging(level, settings.log_format, secret_values)
    tracing.configure(settings, role, "parentbased_always_off" if role == "worker" else None)
    if tracing.ENABLED:
        atexit.register(tracing.shutdown)
