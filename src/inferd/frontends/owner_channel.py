"""The other front ends' private way to the owner (front end 0) of `inferd serve --frontends N`.

The owner listens on a Unix socket in the plan's folder (the parent's, readable by the server's user
only); a follower connects, sends one request (its kind, the plan's token and a payload), closes its
side, and reads the owner's answer to the end: one exchange per connection. Each kind has one handler
on the owner (frontends/traffic_sync.py's canary outcomes, the search writes of api/search_routes.py).
A request with another token, of a kind nobody handles, over the channel's size bound, or not sent
whole within READ_TIMEOUT_S, is closed unanswered.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable

import msgspec

from inferd.errors import PayloadTooLarge
from inferd.frontends.plan import FrontendPlan

log = logging.getLogger("inferd.frontends")

MAX_MESSAGE_BYTES = 64 * 2**20
"""The default bound on a request or an answer (a server allows what its largest request body needs)."""
READ_TIMEOUT_S = 30.0
"""Most the owner waits for a request to arrive whole (a follower sends it at once)."""
READ_CHUNK = 2**16

Handler = Callable[[bytes], Awaitable[bytes]]
"""Takes a request's payload, returns the answer's bytes (errors are the handler's to encode)."""


class Request(msgspec.Struct):
    kind: str
    token: str
    payload: bytes


class OwnerUnreachable(Exception):
    """The owner front end did not answer (it is down or restarting, or it gave up on the request)."""


class OwnerChannel:
    def __init__(self, plan: FrontendPlan, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.plan = plan
        self.max_bytes = max_bytes
        """The bound on a request (the owner's) or an answer (a follower's)."""
        self.handlers: dict[str, tuple[Handler, float]] = {}
        self._server: asyncio.Server | None = None

    def handle(self, kind: str, handler: Handler, timeout_s: float) -> None:
        """The owner answers requests of `kind` with `handler` (given `timeout_s` per request)."""
        self.handlers[kind] = (handler, timeout_s)

    async def open(self) -> None:
        """The owner starts listening (once; a follower has nothing to open)."""
        if self.plan.is_owner and self._server is None:
            self._server = await asyncio.start_unix_server(self._answer, path=self.plan.owner_path())

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def ask(self, kind: str, payload: bytes, timeout_s: float) -> bytes:
        """The owner's answer to one request; OwnerUnreachable when none came within `timeout_s`."""
        sent = msgspec.msgpack.encode(Request(kind, self.plan.token, payload))
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_unix_connection(self.plan.owner_path())
                try:
                    writer.write(sent)
                    writer.write_eof()
                    answer = await read_all(reader, self.max_bytes)
                finally:
                    writer.close()
        except (OSError, TimeoutError, PayloadTooLarge) as exc:
            raise OwnerUnreachable(f"{type(exc).__name__}: {exc}") from None
        if not answer:
            raise OwnerUnreachable("it closed the connection without an answer")
        return answer

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                raw = await read_all(reader, self.max_bytes)
            request = msgspec.msgpack.decode(raw, type=Request)
            handler, timeout_s = self.handlers.get(request.kind, (None, 0.0))
            if handler is None or not hmac.compare_digest(request.token.encode(), self.plan.token.encode()):
                log.warning("owner channel: refused a request of kind %r", request.kind)
                return
            async with asyncio.timeout(timeout_s):
                writer.write(await handler(request.payload))
                await writer.drain()
        except (OSError, TimeoutError, msgspec.DecodeError, PayloadTooLarge) as exc:
            log.warning("owner channel: a front end's request failed: %r", exc)
        finally:
            with contextlib.suppress(OSError):
                writer.close()


async def read_all(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """What the other side sends until it closes its side; PayloadTooLarge past `max_bytes`."""
    data = bytearray()
    while chunk := await reader.read(READ_CHUNK):
        data += chunk
        if len(data) > max_bytes:
            raise PayloadTooLarge(f"an owner channel message over {max_bytes} bytes")
    return bytes(data)
