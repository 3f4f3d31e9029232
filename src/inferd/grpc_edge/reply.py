"""`GrpcReply`: what the request chain returns for a gRPC call (core/call.py `Reply`), so the layers
written for any edge (request context, access log, accounting, tenant counts, model version, cache
result, auth, quotas) run unchanged on gRPC calls.

Its `headers` are the call's trailing metadata, which layers extend as they extend HTTP headers
(x-request-id, x-inferd-model, x-inferd-model-version, the lifecycle record x-inferd-queue-ms...);
`status` is the HTTP twin's status (for spans and the access log); an error reply carries the gRPC
`code` and `details` (grpc_edge/errors.py). The edge sends it with `send`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc import aio


class GrpcReply:
    """A unary call's answer (`message`), or its error (`code`, `details`); a streamed reply (`streamed`)
    runs its `on_close` callbacks when `close()` ends it."""

    __slots__ = ("_closers", "code", "details", "headers", "message", "status", "streamed")

    def __init__(
        self,
        message: Any = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        status: int = 200,
        code: grpc.StatusCode | None = None,
        details: str = "",
        streamed: bool = False,
    ) -> None:
        self.message = message
        self.headers: list[tuple[bytes, bytes]] = [] if headers is None else headers
        self.status = status
        """The HTTP twin's status (200; an error's status in api/errors.py), for spans and the access log."""
        self.code = code
        """None: the call succeeded; else its gRPC status code, with `details` (the REST twin's message)."""
        self.details = details
        self.streamed = streamed
        self._closers: list[Callable[[], None]] | None = None

    @property
    def metadata(self) -> list[tuple[bytes, bytes]]:
        return self.headers

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def on_close(self, callback: Callable[[], None]) -> None:
        """A unary reply has ended when the chain returns it: `callback` runs now; a streamed one's at
        `close()`."""
        if not self.streamed:
            callback()
            return
        if self._closers is None:
            self._closers = []
        self._closers.append(callback)

    def close(self) -> None:
        """A streamed reply has ended, however it ended: its `on_close` callbacks run, once."""
        closers, self._closers = self._closers, None
        for callback in closers or ():
            callback()

    def trailers(self) -> tuple[tuple[str, str], ...]:
        """The headers as gRPC metadata (ASCII names and values: every value our layers set is)."""
        return tuple((k.decode("ascii"), v.decode("latin-1")) for k, v in self.headers)

    async def send(self, context: aio.ServicerContext[Any, Any]) -> Any:
        """The unary answer to return from the servicer method, with the headers as trailing metadata;
        an error reply ends the call with its code and details (context.abort raises)."""
        if self.code is not None:
            await context.abort(self.code, self.details, self.trailers())
        context.set_trailing_metadata(self.trailers())
        return self.message
