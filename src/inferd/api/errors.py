"""The one place HTTP statuses are decided: error type -> status, headers and JSON body."""

from __future__ import annotations

import math

from inferd.errors import (
    BadRequest,
    Conflict,
    DeadlineExceeded,
    Forbidden,
    HeaderTooLarge,
    ModelError,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    ServingError,
    ShuttingDown,
    Unauthorized,
    UnsupportedMediaType,
    WorkerDied,
    WorkerUnavailable,
)

_STATUS: list[tuple[type[ServingError], int, str]] = [
    (BadRequest, 400, "bad_request"),
    (Unauthorized, 401, "unauthorized"),
    (Forbidden, 403, "forbidden"),
    (NotFound, 404, "not_found"),
    (Conflict, 409, "conflict"),
    (RequestTimeout, 408, "request_timeout"),
    (PayloadTooLarge, 413, "too_large"),
    (UnsupportedMediaType, 415, "bad_request"),
    (HeaderTooLarge, 431, "header_too_large"),
    (RateLimited, 429, "rate_limited"),
    (Overloaded, 429, "rejected"),
    (ModelError, 422, "model_error"),
    (WorkerUnavailable, 503, "unavailable"),
    (WorkerDied, 503, "worker_died"),
    (ShuttingDown, 503, "unavailable"),
    (DeadlineExceeded, 504, "deadline"),
]


def status_of(exc: ServingError) -> tuple[int, str]:
    """(HTTP status, outcome label) of an error."""
    for cls, status, outcome in _STATUS:
        if isinstance(exc, cls):
            return status, outcome
    return 500, "internal"


def error_headers(exc: ServingError) -> list[tuple[bytes, bytes]]:
    """Retry-After (and its exact value in ms) for retryable refusals, WWW-Authenticate for a 401, and
    whatever a layer attached as `extra_headers` (e.g. the quota layer's x-ratelimit-*)."""
    extra: list[tuple[bytes, bytes]] = list(getattr(exc, "extra_headers", ()))
    if isinstance(exc, Unauthorized):
        return [(b"www-authenticate", b"Bearer"), *extra]
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is None:
        return extra
    return [
        (b"retry-after", str(max(1, math.ceil(retry_after))).encode()),
        (b"x-inferd-retry-after-ms", f"{retry_after * 1000:.0f}".encode()),
        *extra,
    ]
