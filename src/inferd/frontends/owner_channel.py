"""The other front ends' private way to the owner (front end 0) of `inferd serve --frontends N`.

The owner listens on a Unix socket in the plan's folder (the parent's, readable by the server's user
only); a follower connects, sends one request (its kind, the plan's token and a payload), closes its
side, and reads the owner's answer to the end: one exchange per connection. Each kind has one handler
on the owner (the others' load, versions and reloads, the search writes of api/search_routes.py).
A request with another token, of a kind nobody handles, over the channel's size bound, or not sent
whole within READ_TIMEOUT_S, is closed unanswered.

A follower waiting on a long answer (`ask_watched`: a forwarded search write may embed for minutes)
pings the owner meanwhile: the owner's channel answers a ping itself, from its event loop, so an owner
that is alive but hung (stopped, or its event loop stuck) is told from a slow one within seconds
(`Liveness`), instead of at the request's own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable

import msgspec

from inferd.clock import Clock, MonotonicClock
from inferd.errors import PayloadTooLarge
from inferd.frontends.plan import FrontendPlan

log = logging.getLogger("inferd.frontends")

MAX_MESSAGE_BYTES = 64 * 2**20
"""The default bound on a request or an answer (a server allows what its largest request body needs)."""
READ_TIMEOUT_S = 30.0
"""Most the owner waits for a request to arrive whole (a follower sends it at once)."""
READ_CHUNK = 2**16
PING = "ping"
"""The channel's own request kind: the owner answers it from its event loop, at once."""
PING_EVERY_S = 1.0
"""How often a follower waiting on an answer (`ask_watched`) pings the owner."""
HUNG_AFTER_S = 3.0
"""An owner that answered no ping for this long is hung: the request waiting on it fails."""

Handler = Callable[[bytes], Awaitable[bytes]]
"""Takes a request's payload, returns the answer's bytes (errors are the handler's to encode)."""


class Request(msgspec.Struct):
    kind: str
    token: str
    payload: bytes


class OwnerUnreachable(Exception):
    """The owner front end did not answer (it is down, restarting or hung, or it gave up on the request)."""


class Liveness:
    """Whether the owner still answers while a follower waits on it: pinged every `every_s`, it is hung
    once it answered no ping for `hung_after_s` since the wait began or its last answer. A slow answer
    from an owner that answers pings is waited for; a hung owner's is not. No I/O: `ask_watched` pings."""

    def __init__(
        self, clock: Clock, every_s: float = PING_EVERY_S, hung_after_s: float = HUNG_AFTER_S
    ) -> None:
        self.clock = clock
        self.every_s = every_s
        self.hung_after_s = hung_after_s
        self.heard_at = clock.now()

    def heard(self) -> None:
        """The owner answered a ping."""
        self.heard_at = self.clock.now()

    def silent_s(self) -> float:
        return self.clock.now() - self.heard_at

    def hung(self) -> bool:
        return self.silent_s() >= self.hung_after_s

    def ping_timeout_s(self) -> float:
        """How long the next ping may wait: an answer after the owner counts as hung comes too late."""
        return max(self.hung_after_s - self.silent_s(), 0.0)


class OwnerChannel:
    def __init__(
        self,
        plan: FrontendPlan,
        max_bytes: int = MAX_MESSAGE_BYTES,
        clock: Clock | None = None,
        ping_every_s: float = PING_EVERY_S,
        hung_after_s: float = HUNG_AFTER_S,
    ) -> None:
        self.plan = plan
        self.max_bytes = max_bytes
        """The bound on a request (the owner's) or an answer (a follower's)."""
        self.clock = clock or MonotonicClock()
        self.ping_every_s = ping_every_s
        self.hung_after_s = hung_after_s
        self.handlers: dict[str, tuple[Handler, float]] = {PING: (_pong, hung_after_s)}
        self._server: asyncio.Server | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._watching = 0

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

    async def ask_watched(self, kind: str, payload: bytes, timeout_s: float) -> bytes:
        """`ask`, while the owner is pinged: OwnerUnreachable as soon as the owner answers no ping for
        `hung_after_s` (hung), or, an owner that answers pings, after `timeout_s`. Every watched ask
        pending at once shares one watcher (one ping per `ping_every_s`, however many wait)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._until_hung())
        watcher = self._watcher
        self._watching += 1
        asking = asyncio.ensure_future(self.ask(kind, payload, timeout_s))
        try:
            await asyncio.wait((asking, watcher), return_when=asyncio.FIRST_COMPLETED)
            if asking.done():
                return asking.result()
            watcher.result()  # the owner is hung: raises OwnerUnreachable
            raise OwnerUnreachable("its watcher stopped")  # (it only stops with a verdict)
        finally:
            asking.cancel()
            self._watching -= 1
            if not self._watching:  # the last one waiting: the watcher stops, its verdict retrieved
                if not watcher.done():
                    watcher.cancel()
                elif not watcher.cancelled():
                    watcher.exception()

    async def _until_hung(self) -> None:
        """Pings the owner every `ping_every_s` until it is hung, then raises OwnerUnreachable."""
        liveness = Liveness(self.clock, self.ping_every_s, self.hung_after_s)
        while True:
            await asyncio.sleep(liveness.every_s)
            with contextlib.suppress(OwnerUnreachable):
                await self.ask(PING, b"", liveness.ping_timeout_s())
                liveness.heard()
            if liveness.hung():
                raise OwnerUnreachable(
                    f"it answered no ping for {liveness.silent_s():.1f} s: it is hung (stopped, or its "
                    "event loop is stuck)"
                )

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
        except (ConnectionResetError, BrokenPipeError) as exc:  # it stopped waiting (a ping's answer)
            log.debug("owner channel: a front end left before its answer: %r", exc)
        except (OSError, TimeoutError, msgspec.DecodeError, PayloadTooLarge) as exc:
            log.warning("owner channel: a front end's request failed: %r", exc)
        finally:
            with contextlib.suppress(OSError):
                writer.close()


async def _pong(payload: bytes) -> bytes:
    return b"pong"


async def read_all(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """What the other side sends until it closes its side; PayloadTooLarge past `max_bytes`."""
    data = bytearray()
    while chunk := await reader.read(READ_CHUNK):
        data += chunk
        if len(data) > max_bytes:
            raise PayloadTooLarge(f"an owner channel message over {max_bytes} bytes")
    return bytes(data)
