"""The one table from REST's statuses of the error tree (api/errors.py `status_of`) to gRPC status codes, and `GrpcErrors`, the
chain layer that turns an error into a `GrpcReply`: the gRPC twin of api/middleware.py `Errors`.

Each error's details are the message its REST twin carries; its trailing metadata the REST twin's
headers (api/errors.py `error_headers`): `retry-after` and `x-inferd-retry-after-ms` on a refusal that
names a wait, the quota layer's `x-ratelimit-*`, `www-authenticate` on UNAUTHENTICATED.

| error                                        | code               | REST |
|----------------------------------------------|--------------------|------|
| BadRequest, UnsupportedMediaType             | INVALID_ARGUMENT   | 400, 415 |
| Unauthorized                                 | UNAUTHENTICATED    | 401 |
| Forbidden                                    | PERMISSION_DENIED  | 403 |
| NotFound                                     | NOT_FOUND          | 404 |
| Conflict                                     | FAILED_PRECONDITION| 409 |
| RateLimited, Overloaded, PayloadTooLarge, HeaderTooLarge | RESOURCE_EXHAUSTED | 429, 413, 431 |
| Overloaded for its deadline (the predicted wait exceeds what is left) | DEADLINE_EXCEEDED | 429 |
| WorkerUnavailable, WorkerDied, ShuttingDown  | UNAVAILABLE        | 503 |
| DeadlineExceeded, RequestTimeout             | DEADLINE_EXCEEDED  | 504, 408 |
| ModelError                                   | INTERNAL           | 422 (Triton answers a model's failure INTERNAL; the details say the model failed) |
| the caller left (ClientGone)                 | CANCELLED          | 499 |
| anything else                                | INTERNAL, with an id to quote (never a traceback) | 500 |

A call refused because its deadline cannot be met is DEADLINE_EXCEEDED rather than RESOURCE_EXHAUSTED:
a gRPC client that set the deadline reads it as the deadline's outcome, not as load to back off from
(its trailers still carry the retry-after REST's 429 carries).
"""

from __future__ import annotations

import grpc

from inferd.api.errors import error_headers, status_of
from inferd.api.middleware import internal, refused
from inferd.core.call import Call, Handler
from inferd.errors import ClientGone, Overloaded, ServingError
from inferd.grpc_edge.reply import GrpcReply

Code = grpc.StatusCode

_CODES: dict[int, Code] = {
    400: Code.INVALID_ARGUMENT,
    415: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    409: Code.FAILED_PRECONDITION,
    413: Code.RESOURCE_EXHAUSTED,
    429: Code.RESOURCE_EXHAUSTED,
    431: Code.RESOURCE_EXHAUSTED,
    503: Code.UNAVAILABLE,
    408: Code.DEADLINE_EXCEEDED,
    504: Code.DEADLINE_EXCEEDED,
    422: Code.INTERNAL,
}
"""The code of each REST status: an error is classified once (api/errors.py `status_of`), and each edge
says that class in its own protocol."""


def code_of(exc: ServingError) -> Code:
    """The gRPC status code of an error: its REST twin's status in gRPC (INTERNAL for any other)."""
    if isinstance(exc, Overloaded) and exc.reason == "deadline":
        return Code.DEADLINE_EXCEEDED  # refused up front: the call's deadline cannot be met
    return _CODES.get(status_of(exc)[0], Code.INTERNAL)


def error_reply(call: Call, exc: ServingError) -> GrpcReply:
    """The reply of a call that ends with `exc`, its outcome recorded on the call as REST records it."""
    status = refused(call, exc)
    return GrpcReply(None, error_headers(exc), status, code_of(exc), exc.message)


class GrpcErrors:
    """Errors become error replies: a ServingError its code, details and trailers; a caller that left
    CANCELLED; anything else INTERNAL with an id the caller can quote."""

    def __init__(self, inner: Handler) -> None:
        self.inner = inner

    async def __call__(self, call: Call, request: object) -> GrpcReply:
        try:
            return await self.inner(call, request)
        except ServingError as exc:
            return error_reply(call, exc)
        except ClientGone:
            call.outcome = "cancelled"
            return GrpcReply(None, None, 499, Code.CANCELLED, "the caller cancelled the call")
        except Exception as exc:
            return GrpcReply(None, None, 500, Code.INTERNAL, internal(call, exc).message)
