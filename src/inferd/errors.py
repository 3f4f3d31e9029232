"""The one error tree. HTTP statuses live in api/errors.py only.

Across process boundaries errors travel as (code, message), never pickled: `code` is the class name.
"""

from __future__ import annotations

import math


class ServingError(Exception):
    """Base of every error inferd answers a caller with."""

    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def code(self) -> str:
        return type(self).__name__


class ClientError(ServingError):
    """The request itself is at fault."""


class BadRequest(ClientError):
    pass


class NotFound(ClientError):
    """Unknown model, version or route."""


class Conflict(ClientError):
    """The request contradicts what exists (an index of that name with other settings)."""


class PayloadTooLarge(ClientError):
    pass


class UnsupportedMediaType(ClientError):
    pass


class Unauthorized(ClientError):
    """No valid credential: a missing, unknown or expired API key."""


class Forbidden(ClientError):
    """A valid credential that does not allow this call (a model outside the tenant's list)."""


class HeaderTooLarge(ClientError):
    """The request head is over the size or header-count limit."""


class RequestTimeout(ClientError):
    """The client did not send its request head, or its body, in time."""


class RateLimited(ClientError):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(ServingError):
    """Rejected before any work began: safe to retry, later or elsewhere."""

    retryable = True

    def __init__(self, message: str, retry_after_s: float, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


def retry_after_s(drain_s: float) -> int:
    """HTTP Retry-After is whole seconds; never 0 (that invites an immediate retry storm)."""
    return max(1, math.ceil(drain_s))


class DeadlineExceeded(ServingError):
    pass


class WorkerUnavailable(ServingError):
    """No worker of the model can take work (none up, or all draining)."""

    retryable = True

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClusterUnavailable(WorkerUnavailable):
    """A change of the served state (a rolling update, scaling, a canary step) that cannot be made now:
    the cluster store does not answer, or this front end no longer holds the lease that such changes
    need (cluster/lease.py). Serving goes on with the last state read."""


class WorkerDied(ServingError):
    """The worker running this request's batch went away."""

    retryable = True

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ModelError(ServingError):
    """The model failed on this input. Deterministic, so never retried."""


class ModelOutputError(ModelError):
    """The model broke its contract for a whole batch (wrong number of outputs): every caller fails."""


class ShuttingDown(ServingError):
    retryable = True


class Internal(ServingError):
    pass


class ClientGone(Exception):
    """The caller disconnected while its request was queued or running (the routes answer 499 to no one).
    Not a ServingError: nobody is left to answer. Raised wherever a wait learns of it (core/disconnect.py,
    kinds/batch/service.py), so it lives here, below both."""


_BY_CODE: dict[str, type[ServingError]] = {
    cls.__name__: cls
    for cls in (
        BadRequest,
        Conflict,
        Forbidden,
        NotFound,
        PayloadTooLarge,
        UnsupportedMediaType,
        ModelError,
        ModelOutputError,
        Internal,
        DeadlineExceeded,
        WorkerDied,
        ShuttingDown,
    )
}
_RETRY_AFTER_BY_CODE: dict[str, type[RateLimited] | type[Overloaded] | type[WorkerUnavailable]] = {
    cls.__name__: cls for cls in (RateLimited, Overloaded, WorkerUnavailable)
}


def from_wire(code: str, message: str, retry_after_s: float | None = None) -> ServingError:
    """Rebuild an error sent as (code, message) by another process. An error that carries a Retry-After
    (429, 503) is rebuilt as itself only when the sender sent its `retry_after_s`; any code not known
    here is Internal."""
    if retry_after_s is not None and code in _RETRY_AFTER_BY_CODE:
        return _RETRY_AFTER_BY_CODE[code](message, retry_after_s)
    return _BY_CODE.get(code, Internal)(message)
