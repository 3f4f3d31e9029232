"""The front ends' private way to one another: a request to a named front end, its answer back.

Every front end listens for the others' requests: on one host (`inferd serve --frontends N`) on its
Unix socket in the plan's folder (the parent's, readable by the server's user only), with the plan's
token; across hosts on TCP, at the address its record `frontend/<id>` names (cluster/members.py), with
the cluster's join token (`[server] join_token`; never a client's key: the asking front end checked
its client). A front end asks another by its address (`unix:PATH` or `HOST:PORT`): it connects, sends
one request (a small header: its kind and the token of that transport; then its payload), closes its
side, and reads the answer to the end: one exchange per connection. The header is read and checked
before the payload: a stranger without the token gets no more than MAX_HEADER_BYTES read. Each kind has one handler where it is answered (the
search writes of api/search_routes.py, forwarded to the index's writer or to the holder of the
`decider` lease). A request with another token, of a kind nobody handles, over the channel's size
bound, or not sent whole within READ_TIMEOUT_S, is closed unanswered.

A front end waiting on a long answer (`ask_watched`: a forwarded search write may embed for minutes)
pings the one it asked meanwhile: the channel answers a ping itself, from its event loop, so a front
end that is alive but hung (stopped, or its event loop stuck) is told from a slow one within seconds
(`Liveness`), instead of at the request's own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import struct
from collections.abc import Awaitable, Callable

import msgspec

from inferd.clock import Clock, MonotonicClock
from inferd.config.identity import EVERY_ADDRESS
from inferd.errors import PayloadTooLarge

log = logging.getLogger("inferd.frontends")

MAX_MESSAGE_BYTES = 64 * 2**20
"""The default bound on a request or an answer (a server allows what its largest request body needs)."""
READ_TIMEOUT_S = 30.0
"""Most a front end waits for a request to arrive whole (the asking one sends it at once)."""
READ_CHUNK = 2**16
MAX_HEADER_BYTES = 4096
"""The most read of a request before its token is checked (its header: the kind and the token)."""
_HEADER_LEN = struct.Struct(">I")
PING = "ping"
"""The channel's own request kind: answered from the event loop, at once."""
PING_EVERY_S = 1.0
"""How often a front end waiting on an answer (`ask_watched`) pings the one it asked."""
HUNG_AFTER_S = 3.0
"""A front end that answered no ping for this long is hung: the request waiting on it fails."""
UNIX = "unix:"

Handler = Callable[[bytes], Awaitable[bytes]]
"""Takes a request's payload, returns the answer's bytes (errors are the handler's to encode)."""


class Header(msgspec.Struct, array_like=True):
    """What comes first on a request's connection, length-prefixed; the payload follows to the end."""

    kind: str
    token: str


def encode_request(kind: str, token: str, payload: bytes) -> bytes:
    header = msgspec.msgpack.encode(Header(kind, token))
    return _HEADER_LEN.pack(len(header)) + header + payload


async def read_header(reader: asyncio.StreamReader) -> Header:
    """A request's header; ValueError when it is not one, or is over MAX_HEADER_BYTES."""
    try:
        (size,) = _HEADER_LEN.unpack(await reader.readexactly(_HEADER_LEN.size))
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"a front end channel header of {size} bytes (at most {MAX_HEADER_BYTES})")
        return msgspec.msgpack.decode(await reader.readexactly(size), type=Header)
    except (asyncio.IncompleteReadError, msgspec.DecodeError) as exc:
        raise ValueError(f"not a front end channel request: {exc}") from None


class PeerUnreachable(Exception):
    """The front end asked did not answer (it is down, restarting or hung, or it gave up on the request)."""


class Liveness:
    """Whether the front end asked still answers while another waits on it: pinged every `every_s`, it
    is hung once it answered no ping for `hung_after_s` since the wait began or its last answer. A slow
    answer from one that answers pings is waited for; a hung one's is not. No I/O: `ask_watched` pings."""

    def __init__(
        self, clock: Clock, every_s: float = PING_EVERY_S, hung_after_s: float = HUNG_AFTER_S
    ) -> None:
        self.clock = clock
        self.every_s = every_s
        self.hung_after_s = hung_after_s
        self.heard_at = clock.now()

    def heard(self) -> None:
        """It answered a ping."""
        self.heard_at = self.clock.now()

    def silent_s(self) -> float:
        return self.clock.now() - self.heard_at

    def hung(self) -> bool:
        return self.silent_s() >= self.hung_after_s

    def ping_timeout_s(self) -> float:
        """How long the next ping may wait: an answer after it counts as hung comes too late."""
        return max(self.hung_after_s - self.silent_s(), 0.0)


class FrontendChannel:
    def __init__(
        self,
        token: str,
        path: str | None = None,
        join_token: str | None = None,
        max_bytes: int = MAX_MESSAGE_BYTES,
        clock: Clock | None = None,
        ping_every_s: float = PING_EVERY_S,
        hung_after_s: float = HUNG_AFTER_S,
    ) -> None:
        self.token = token
        """The token of the Unix sockets of one host's front ends (the plan's)."""
        self.path = path
        """This front end's Unix socket (None: it listens on none)."""
        self.join_token = join_token or ""
        """The token over TCP, between hosts (the cluster's join token; "": no TCP, either way)."""
        self.max_bytes = max_bytes
        """The bound on a request (where it is answered) or an answer (where it was asked)."""
        self.clock = clock or MonotonicClock()
        self.ping_every_s = ping_every_s
        self.hung_after_s = hung_after_s
        self.handlers: dict[str, tuple[Handler, float]] = {PING: (_pong, hung_after_s)}
        self.tcp_address: str | None = None
        """Where the others reach this front end over TCP once `open` listens there (HOST:PORT)."""
        self._servers: list[asyncio.Server] = []
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._watching: dict[str, int] = {}

    def handle(self, kind: str, handler: Handler, timeout_s: float) -> None:
        """Requests of `kind` are answered here with `handler` (given `timeout_s` per request)."""
        self.handlers[kind] = (handler, timeout_s)

    async def open(self, tcp: tuple[str, str] | None = None) -> None:
        """Listen on this front end's Unix socket, and, given `tcp` (the host to bind, the host the
        others reach it by) and a join token, on TCP at a port the system picks (`tcp_address`). Once."""
        if self._servers:
            return
        if self.path is not None:
            self._servers.append(
                await asyncio.start_unix_server(functools.partial(self._answer, self.token), path=self.path)
            )
        if tcp is not None and self.join_token:
            bind, reached_at = tcp
            server = await asyncio.start_server(functools.partial(self._answer, self.join_token), bind or None, 0)
            self._servers.append(server)
            port = server.sockets[0].getsockname()[1]
            self.tcp_address = f"[{reached_at}]:{port}" if ":" in reached_at else f"{reached_at}:{port}"

    def address(self) -> str | None:
        """Where the other front ends reach this one: over TCP when it listens there, else its Unix
        socket (one host's front ends)."""
        if self.tcp_address is not None:
            return self.tcp_address
        return None if self.path is None else UNIX + self.path

    def close(self) -> None:
        for server in self._servers:
            server.close()
        self._servers = []

    async def ask(self, to: str, kind: str, payload: bytes, timeout_s: float) -> bytes:
        """The answer of the front end at `to` (`unix:PATH` or `HOST:PORT`) to one request;
        PeerUnreachable when none came within `timeout_s`."""
        unix = to.startswith(UNIX)
        token = self.token if unix else self.join_token
        if not token:
            raise PeerUnreachable(f"{to} is another host's front end, and this one has no join token to ask it")
        sent = encode_request(kind, token, payload)
        try:
            async with asyncio.timeout(timeout_s):
                if unix:
                    reader, writer = await asyncio.open_unix_connection(to[len(UNIX) :])
                else:
                    host, _, port = to.rpartition(":")
                    reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
                try:
                    writer.write(sent)
                    writer.write_eof()
                    answer = await read_all(reader, self.max_bytes)
                finally:
                    writer.close()
        except (OSError, TimeoutError, PayloadTooLarge, ValueError) as exc:
            raise PeerUnreachable(f"{type(exc).__name__}: {exc}") from None
        if not answer:
            raise PeerUnreachable("it closed the connection without an answer")
        return answer

    async def ask_watched(self, to: str, kind: str, payload: bytes, timeout_s: float) -> bytes:
        """`ask`, while the front end at `to` is pinged: PeerUnreachable as soon as it answers no ping
        for `hung_after_s` (hung), or, one that answers pings, after `timeout_s`. Every watched ask
        pending at once on one front end shares one watcher (one ping per `ping_every_s`, however many
        wait)."""
        watcher = self._watchers.get(to)
        if watcher is None or watcher.done():
            watcher = self._watchers[to] = asyncio.create_task(self._until_hung(to))
        self._watching[to] = self._watching.get(to, 0) + 1
        asking = asyncio.ensure_future(self.ask(to, kind, payload, timeout_s))
        try:
            await asyncio.wait((asking, watcher), return_when=asyncio.FIRST_COMPLETED)
            if asking.done():
                return asking.result()
            watcher.result()  # it is hung: raises PeerUnreachable
            raise PeerUnreachable("its watcher stopped")  # (it only stops with a verdict)
        finally:
            asking.cancel()
            self._watching[to] -= 1
            if not self._watching[to]:  # the last one waiting: the watcher stops, its verdict retrieved
                del self._watching[to]
                if self._watchers.get(to) is watcher:
                    del self._watchers[to]
                if not watcher.done():
                    watcher.cancel()
                elif not watcher.cancelled():
                    watcher.exception()

    async def _until_hung(self, to: str) -> None:
        """Pings `to` every `ping_every_s` until it is hung, then raises PeerUnreachable."""
        liveness = Liveness(self.clock, self.ping_every_s, self.hung_after_s)
        while True:
            await asyncio.sleep(liveness.every_s)
            with contextlib.suppress(PeerUnreachable):
                await self.ask(to, PING, b"", liveness.ping_timeout_s())
                liveness.heard()
            if liveness.hung():
                raise PeerUnreachable(
                    f"it answered no ping for {liveness.silent_s():.1f} s: it is hung (stopped, or its "
                    "event loop is stuck)"
                )

    async def _answer(self, token: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                header = await read_header(reader)
                handler, timeout_s = self.handlers.get(header.kind, (None, 0.0))
                if handler is None or not hmac.compare_digest(header.token.encode(), token.encode()):
                    log.warning("front end channel: refused a request of kind %r", header.kind)
                    return
                payload = await read_all(reader, self.max_bytes)
            async with asyncio.timeout(timeout_s):
                writer.write(await handler(payload))
                await writer.drain()
        except (ConnectionResetError, BrokenPipeError) as exc:  # it stopped waiting (a ping's answer)
            log.debug("front end channel: a front end left before its answer: %r", exc)
        except (OSError, TimeoutError, ValueError, PayloadTooLarge) as exc:
            log.warning("front end channel: a front end's request failed: %r", exc)
        finally:
            with contextlib.suppress(OSError):
                writer.close()


def tcp_host(worker_host: str, frontend_id: str) -> tuple[str, str] | None:
    """(the host to bind, the host the others reach it by) of a front end's channel over TCP: where its
    workers on other hosts join it (`--worker-host`), or, when that is every address, the host of its
    id (`--frontend-id POD_IP:PORT`). None: neither names a host another can reach."""
    reached_at = worker_host
    if reached_at in EVERY_ADDRESS:
        reached_at = frontend_id.rpartition(":")[0].strip("[]")
    return None if reached_at in EVERY_ADDRESS else (worker_host.strip("[]"), reached_at)


async def _pong(payload: bytes) -> bytes:
    return b"pong"


async def read_all(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """What the other side sends until it closes its side; PayloadTooLarge past `max_bytes`."""
    data = bytearray()
    while chunk := await reader.read(READ_CHUNK):
        data += chunk
        if len(data) > max_bytes:
            raise PayloadTooLarge(f"a front end channel message over {max_bytes} bytes")
    return bytes(data)
