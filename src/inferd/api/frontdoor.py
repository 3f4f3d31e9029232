"""The front door: inferd's own HTTP/1.1 connection (an asyncio protocol over httptools' parser), with
limits on slow, idle and too many clients.

Each connection gets a total deadline for its request head (from when it opens, or from the first byte
of the next request on a keep-alive connection) and one for its body; heads over the size or line
limits get 431; connections over the caps, in all or per client address, get 429 at once; requests over
the admission rate get 429 as soon as their head is parsed, before the app and before their body is read.
What to allow is DoorPolicy's decision (door_policy.py); this protocol only arms timers and writes.

Refusals that close the connection close it gracefully: the response, then our FIN, then whatever the
client still sends is read and dropped until it closes (or LINGER_S), so the client reads the answer
instead of a reset.

Why our own protocol and not a subclass of uvicorn's: uvicorn's httptools protocol turns every request
into ASGI messages (a scope, receive() and send() coroutines, a header pass that re-validates what we
write, two writes per response). Measured with the same load tool at 3,000 req/s on the 2-core machine,
a trivial app cost 90 us of CPU per request under it against 44 us under a bare httptools protocol
(benchmarks/http_floor.py, docs/benchmarks.md), and its internals were what the old subclass overrode.
Here a request reaches `AsgiApp.handle` as an `HttpRequest` whose peer is its `Exchange` (exchange.py):
the body is read from the parser's buffer, a disconnect calls back, and a response is one write.

uvicorn still runs the server (sockets, TLS, signals, lifespan, graceful shutdown) through its public
`Config(http=<protocol class>)`: the contract with it is this class's constructor (config,
server_state, app_state), `shutdown()`, and `server_state.connections`, `.tasks`, `.total_requests`
and `.default_headers` (tests/unit/test_uvicorn_contract.py checks them).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import httptools

from inferd.api.asgi import AsgiApp
from inferd.api.door_policy import DoorPolicy
from inferd.api.exchange import HIGH_WATER_BYTES, Exchange, bad_request, canned_response, request_scope
from inferd.errors import ServingError

log = logging.getLogger("inferd.frontdoor")

LINGER_S = 2.0
"""After a refusal that closes, how long the client's remaining bytes are read and dropped."""


class _HeadRefused(Exception):
    """Stops the parser inside a callback; the refusal itself waits in the protocol (or was sent)."""


class FrontDoorProtocol(asyncio.Protocol):
    """One client connection. Build the class with `front_door_protocol`."""

    door: DoorPolicy
    app: AsgiApp

    def __init__(self, config: Any, server_state: Any, app_state: Any = None, _loop: Any = None) -> None:
        self.server_state = server_state
        self.loop = _loop or asyncio.get_event_loop()
        self.keep_alive_s: float = config.timeout_keep_alive
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # answer a pipelined first
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.running: Exchange | None = None
        """The request the app runs now."""
        self.parsing: Exchange | None = None
        """The request whose body the parser is reading (the last head parsed)."""
        self.pipeline: deque[Exchange] = deque()
        self.reading_paused = False
        self.writing_paused = False
        self._drained: list[asyncio.Future[None]] = []
        self._ip = ""
        self._counted = False
        self._due: Callable[[], None] | None = None
        """What to do at `_due_at` (a head, body or keep-alive deadline); None: nothing is due."""
        self._due_at = 0.0
        self._wakeup: asyncio.TimerHandle | None = None
        """One loop timer, at or before `_due_at`: moving a deadline later re-arms nothing."""
        self._linger: asyncio.TimerHandle | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect_continue = False
        self._in_head = False
        self._head_begun = False
        self._raw_head = 0
        self._parsed_head = 0
        self._completed_in_feed = False
        self._requests = 0
        self._refusal: ServingError | None = None
        """A head refused inside a parser callback."""
        self._refused: ServingError | None = None
        """A connection refused at a cap, answered when its first bytes come."""
        self._skip_body = False
        self._last_word: bytes | None = None  # a refusal waiting for the responses before it
        self.closing = False

    # ---- connection events ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.server_state.connections.add(self)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        self._ip = self.client[0] if self.client else ""
        refusal = self.door.connect(self._ip)
        if refusal is not None:  # answered when the request comes: clients drop unasked-for bytes
            self._refused = refusal
            self._linger = self.loop.call_later(LINGER_S, transport.close)
            return
        self._counted = True
        self._in_head = True
        self._arm(self.door.limits.header_timeout_s, self._head_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        self._due = None
        for handle in (self._wakeup, self._linger):
            if handle is not None:
                handle.cancel()
        if self._counted:
            self._counted = False
            self.door.disconnect(self._ip)
        for ex in (self.running, self.parsing, *self.pipeline):
            if ex is not None:
                ex.lost()
        self.resume_writing()
        self.pipeline.clear()
        self.parser = None  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # lingering after a refusal: dropped
        if self._refused is not None:
            self.close_with(self._refused)
            return
        self._completed_in_feed = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            log.warning("Unsupported upgrade request.")  # served as plain HTTP, as before
        except httptools.HttpParserError:
            if self.closing:  # a callback answered, closed and stopped the parser on purpose
                return
            if self._refusal is not None:
                self.close_with(self._refusal)
                return
            log.warning("Invalid HTTP request received.")
            self.closing = True
            self._close(bad_request(self.server_state.default_headers))
            return
        if self._in_head:  # a head still incomplete: its bytes so far, buffered by the parser
            if not self._completed_in_feed:  # else this head began after a request in the same data
                self._raw_head += len(data)
            refusal = self.door.check_head(max(self._raw_head, self._parsed_head), len(self._headers))
            if refusal is not None:
                self.close_with(refusal)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        waiters, self._drained = self._drained, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def drain(self) -> None:
        """Until the transport's buffer is below its low-water mark (or the connection is gone)."""
        if self.writing_paused and not self.transport.is_closing():
            fut = self.loop.create_future()
            self._drained.append(fut)
            await fut

    # ---- parser callbacks -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect_continue = False
        self._in_head = self._head_begun = True
        self._raw_head = self._parsed_head = 0
        if self._due != self._head_expired and (self.running is None or self.running.complete):
            # ends an idle wait (not bytes that begin no request); a pipelined head's runs from its turn
            self._arm(self.door.limits.header_timeout_s, self._head_expired)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._parsed_head += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))
        self._parsed_head += len(name) + len(value) + 4
        refusal = self.door.check_head(self._parsed_head, len(self._headers))
        if refusal is not None:
            self._refusal = refusal
            raise _HeadRefused

    def on_headers_complete(self) -> None:
        self._due = None
        self._in_head = self._head_begun = False
        self._requests += 1
        refusal = self.door.admit(self._url)
        if refusal is not None and (self.running is None or self.running.complete):
            self._refuse_request(refusal)
        else:
            ex = self._exchange(refusal)
            self.parsing = ex
            if self.running is None or self.running.complete:
                self._start(ex)
            else:  # pipelined behind a request still running: answered in turn
                self.pipeline.append(ex)
                self.pause_reading()
        if not self.pipeline and not self.closing:  # a pipelined body is read once its request runs
            self._arm(self.door.limits.body_timeout_s, self._body_expired)

    def on_body(self, body: bytes) -> None:
        if not self._skip_body and self.parsing is not None:
            if self.parsing.add_body(body) > HIGH_WATER_BYTES:
                self.pause_reading()

    def on_message_complete(self) -> None:
        self._due = None
        self._completed_in_feed = True
        if self._skip_body:  # a refused request's body has gone by: the connection is idle again
            self._skip_body = False
            self.response_done(None)
            return
        ex = self.parsing
        if ex is not None:
            self.parsing = None
            ex.end_body()
            if ex.complete and not self.pipeline and self.running is ex:  # answered before its body ended
                self._arm(self.keep_alive_s, self._idle_expired)

    # ---- requests -------------------------------------------------------------------------------

    def _exchange(self, refusal: ServingError | None) -> Exchange:
        parser = self.parser
        scope = request_scope(parser, self._url, self._headers, self.client, self.scheme)
        keep_alive = scope["http_version"] != "1.0" and parser.should_keep_alive()
        ex = Exchange(self, scope, keep_alive and self.door.keep_alive(self._requests), self._expect_continue)
        if refusal is not None:
            ex.refusal = refusal
            self._report()
        return ex

    def _start(self, ex: Exchange) -> None:
        self.running = ex
        task = self.loop.create_task(ex.run(self.app))
        self.server_state.tasks.add(task)
        task.add_done_callback(self.server_state.tasks.discard)

    def response_done(self, ex: Exchange | None) -> None:
        """A response has been written whole (`ex`; None: a refusal written without the app)."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if ex is not None and not ex.keep_alive:
            answer, self._last_word = self._last_word, None
            if self.pipeline or (answer is None and self.parsing is None):  # (pipeline: a shutdown)
                self.transport.close()
            else:  # a refusal waited, or the body still comes: the client reads the answer, not a reset
                self.closing = True
                self._close(answer)
            return
        if self.pipeline:
            self._start(after := self.pipeline.popleft())
            if self.parsing is after:  # its body is read from now on, under its deadline
                self._arm(self.door.limits.body_timeout_s, self._body_expired)
        elif self._head_begun:  # the next head, pipelined: the client's to finish from now
            self._arm(self.door.limits.header_timeout_s, self._head_expired)
        elif self.parsing is None:  # else its body's deadline still runs
            self._arm(self.keep_alive_s, self._idle_expired)
        if not self.pipeline:  # else the heads queued are read: no more until they have run
            self.resume_reading()

    def shutdown(self) -> None:
        """The server is stopping: close now if idle, else after the response under way."""
        if self.running is None or self.running.complete:
            self.transport.close()
        else:
            self.running.keep_alive = False

    def pause_reading(self) -> None:
        if not self.reading_paused and not self.transport.is_closing():
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and not self.transport.is_closing():
            self.reading_paused = False
            self.transport.resume_reading()

    def _refuse_request(self, exc: ServingError) -> None:
        """Answer a refused request at once, without the app; its body, if any, is skipped unread."""
        self._report()
        keep = self.parser.should_keep_alive() and self.door.keep_alive(self._requests)
        if keep and not self._expect_continue:  # (no 100 Continue: the body may never come)
            self.transport.write(canned_response(exc, close=False))
            self._skip_body = True
        else:
            self.close_with(exc)
            raise _HeadRefused  # nothing more of this connection is parsed

    # ---- deadlines and refusals -----------------------------------------------------------------

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        """`callback` in `delay_s`, replacing what was due. Each request moves its deadlines a few
        times; the loop timer is re-armed only when a deadline moves earlier than it."""
        due_at = self.loop.time() + delay_s
        self._due, self._due_at = callback, due_at
        wakeup = self._wakeup
        if wakeup is None or wakeup.when() > due_at:
            if wakeup is not None:
                wakeup.cancel()
            self._wakeup = self.loop.call_at(due_at, self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._wakeup = None
        due = self._due
        if due is None:
            return
        if self.loop.time() < self._due_at:  # moved later since the timer was armed
            self._wakeup = self.loop.call_at(self._due_at, self._on_wakeup)
            return
        self._due = None
        due()

    def _idle_expired(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _head_expired(self) -> None:
        exc = self.door.head_timed_out()
        self.close_with(exc if self._head_begun else None)  # nothing sent at all: a plain close

    def _body_expired(self) -> None:
        exc = self.door.body_timed_out()
        started = self._skip_body or (self.parsing is not None and self.parsing.response_started)
        self.close_with(None if started else exc)

    def close_with(self, exc: ServingError | None) -> None:
        """Answer `exc` (if any), end our side, drop what the client still sends, then close."""
        self._due = None
        self.closing = True
        if exc is not None:
            self._report()
        self._close(None if exc is None else canned_response(exc))

    def _close(self, answer: bytes | None) -> None:
        if answer is not None and self._answer_last(answer):
            return
        for ex in (self.running, self.parsing, *self.pipeline):
            if ex is not None and not ex.complete:
                ex.lost()  # the app's body read fails, its responses are dropped
        transport = self.transport
        if transport.is_closing():
            return
        if answer is not None:
            transport.write(answer)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.resume_reading()
        self._linger = self.loop.call_later(LINGER_S, transport.close)

    def _answer_last(self, answer: bytes) -> bool:
        """Whether `answer` waits (else read as theirs) for the requests still to answer: the last closes."""
        last = self.pipeline[-1] if self.pipeline else self.running
        if last is None or last.complete or self.parsing is not None:  # (mid-body: none can be answered)
            return False
        last.keep_alive = False
        self._last_word = answer
        self.pause_reading()
        return True

    def _report(self) -> None:
        if self.door.report_due():
            stats = self.door.statistics()
            log.warning(
                "front door refusing: %d connections open; refused or closed so far: %s",
                stats.open_connections,
                stats.refused,
            )


def front_door_protocol(door: DoorPolicy, app: AsgiApp) -> type[FrontDoorProtocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`: every connection shares `door` and
    hands its requests to `app`."""
    return type("FrontDoorProtocol", (FrontDoorProtocol,), {"door": door, "app": app})
