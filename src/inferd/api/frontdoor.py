"""The front door: uvicorn's httptools protocol with limits on slow, idle and too many clients.

Each connection gets a total deadline for its request head (from when it opens, or from the first byte
of the next request on a keep-alive connection) and one for its body; heads over the size or line
limits get 431; connections over the caps, in all or per client address, get 429 at once; requests over
the admission rate get 429 as soon as their head is parsed, before the app and before their body is read.
What to allow is DoorPolicy's decision (door_policy.py); this protocol only arms timers and writes.

Refusals that close the connection close it gracefully: the response, then our FIN, then whatever the
client still sends is read and dropped until it closes (or LINGER_S), so the client reads the answer
instead of a reset.

uvicorn's private code is a contract here, pinned to the minor it was checked against (pyproject.toml):
FrontDoorProtocol extends HttpToolsProtocol's __init__, connection_made/lost, parser callbacks (on_*)
and _start_asgi_task, replaces data_received with a copy plus its checks, calls its
_unset_keepalive_if_required, _should_upgrade, handle_websocket_upgrade, _unsupported_upgrade_warning,
send_400_response and on_response_complete, and reads self.app (swapped for one on_headers_complete),
loop, logger, parser, pipeline ((cycle, app) pairs), cycle, transport, flow, client and url, and
RequestResponseCycle's keep_alive, response_started, response_complete, disconnected and
message_event. tests/unit/test_uvicorn_contract.py fails, naming the method or attribute, when any of
these changes shape or code: re-check this file against uvicorn's diff before moving the pin.

What would let it drop the subclass: a server that offers, as options or hooks, a deadline for each
request's head and one for its body, limits on head bytes and header count answered with 431, and a
call at accept (caps per client address) and after each head (admission) that may answer at once and
close gracefully. uvicorn 0.54 has none of these: only timeout_keep_alive, h11_max_incomplete_event_size
(h11 only) and limit_concurrency (a 503 over all connections and tasks, none per client). Another ASGI
server (hypercorn, granian) would do only if it has all of them, which has not been checked. Or: our own
asyncio.Protocol over httptools that runs the ASGI app itself, so that this code owns what it now
borrows (about the size of uvicorn's httptools_impl.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import httptools
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from inferd.api.door_policy import DoorPolicy
from inferd.api.errors import error_headers, status_of
from inferd.errors import ServingError

log = logging.getLogger("inferd.frontdoor")

LINGER_S = 2.0
"""After a refusal that closes, how long the client's remaining bytes are read and dropped."""


class _HeadRefused(Exception):
    """Stops the parser inside a callback; the refusal itself waits in the protocol (or was sent)."""


def _refusal_body(exc: ServingError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    status, _ = status_of(exc)
    body = json.dumps({"error": exc.message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return status, headers + error_headers(exc), body


def canned_response(exc: ServingError, close: bool = True) -> bytes:
    """A whole HTTP/1.1 response for `exc`, written without the app."""
    status, headers, body = _refusal_body(exc)
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    head += [name + b": " + value for name, value in headers]
    if close:
        head.append(b"connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def refusal_app(exc: ServingError) -> Callable[..., Any]:
    """An ASGI app that answers `exc` and nothing else: the connection stays open for the next request
    (uvicorn's parser skips the unread body)."""
    status, headers, body = _refusal_body(exc)

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


class FrontDoorProtocol(HttpToolsProtocol):
    """uvicorn's HttpToolsProtocol, with DoorPolicy's limits. Build the class with `front_door_protocol`."""

    door: DoorPolicy

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ip = ""
        self._counted = False
        self._timer: asyncio.TimerHandle | None = None
        self._in_head = False
        self._head_begun = False
        self._raw_head = 0
        self._parsed_head = 0
        self._header_count = 0
        self._completed_in_feed = False
        self._requests = 0
        self._refusal: ServingError | None = None
        """A head refused inside a parser callback."""
        self._refused: ServingError | None = None
        """A connection refused at a cap, answered when its first bytes come."""
        self._skip_body = False
        self._closing = False
        self._running: RequestResponseCycle | None = None

    # connection events

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._ip = self.client[0] if self.client else ""
        refusal = self.door.connect(self._ip)
        if refusal is not None:  # answered when the request comes: clients drop unasked-for bytes
            self._refused = refusal
            self._timer = self.loop.call_later(LINGER_S, transport.close)
            return
        self._counted = True
        self._in_head = True
        self._arm(self.door.limits.header_timeout_s, self._head_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._counted:
            self._counted = False
            self.door.disconnect(self._ip)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # lingering after a refusal: dropped
        if self._refused is not None:
            self._close_with(self._refused)
            return
        self._unset_keepalive_if_required()
        self._completed_in_feed = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._closing:  # a callback answered, closed and stopped the parser on purpose
                return
            if self._refusal is not None:
                self._close_with(self._refusal)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        if self._in_head:  # a head still incomplete: its bytes so far, buffered by the parser
            if not self._completed_in_feed:  # else this head began after a request in the same data
                self._raw_head += len(data)
            refusal = self.door.check_head(max(self._raw_head, self._parsed_head), self._header_count)
            if refusal is not None:
                self._close_with(refusal)

    # parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = self._head_begun = True
        self._raw_head = self._parsed_head = self._header_count = 0
        if self._timer is None:  # a keep-alive connection's next request; the first one's runs from open
            self._arm(self.door.limits.header_timeout_s, self._head_expired)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._parsed_head += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._parsed_head += len(name) + len(value) + 4
        self._header_count += 1
        refusal = self.door.check_head(self._parsed_head, self._header_count)
        if refusal is not None:
            self._refusal = refusal
            raise _HeadRefused

    def on_headers_complete(self) -> None:
        self._cancel_timer()
        self._in_head = self._head_begun = False
        self._requests += 1
        refusal = self.door.admit(self.url)
        if refusal is None:
            super().on_headers_complete()
            if not self.door.keep_alive(self._requests):
                self.cycle.keep_alive = False
        elif self.cycle is None or self.cycle.response_complete:
            self._refuse_request(refusal)
        else:  # pipelined behind a request still running: answered in turn, by a stand-in app
            app, self.app = self.app, refusal_app(refusal)
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        if not self.pipeline and not self._closing:  # a pipelined body is read once its request runs
            self._arm(self.door.limits.body_timeout_s, self._body_expired)

    def on_body(self, body: bytes) -> None:
        if not self._skip_body:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_timer()
        self._completed_in_feed = True
        if self._skip_body:  # a refused request's body has gone by: the connection is idle again
            self._skip_body = False
            self.on_response_complete()
            return
        super().on_message_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle  # the one request the app runs now (self.cycle may be a later, queued one)
        super()._start_asgi_task(cycle, app)

    def _refuse_request(self, exc: ServingError) -> None:
        """Answer a refused request at once, without the app; its body, if any, is skipped unread."""
        self._report()
        if self.parser.should_keep_alive() and self.door.keep_alive(self._requests):
            self.transport.write(canned_response(exc, close=False))
            self._skip_body = True
        else:
            self._close_with(exc)
            raise _HeadRefused  # nothing more of this connection is parsed

    # deadlines and refusals

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(delay_s, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_expired(self) -> None:
        self._timer = None
        exc = self.door.head_timed_out()
        self._close_with(exc if self._head_begun else None)  # nothing sent at all: a plain close

    def _body_expired(self) -> None:
        self._timer = None
        exc = self.door.body_timed_out()
        started = self._skip_body or (self.cycle is not None and self.cycle.response_started)
        self._close_with(None if started else exc)

    def _close_with(self, exc: ServingError | None) -> None:
        """Answer `exc` (if any), end our side, drop what the client still sends, then close."""
        self._cancel_timer()
        self._closing = True
        if exc is not None:
            self._report()
        for cycle in (self._running, self.cycle, *(c for c, _ in self.pipeline)):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app's receive() gets http.disconnect, its send() is dropped
                cycle.message_event.set()
        transport = self.transport
        if transport.is_closing():
            return
        if exc is not None:
            transport.write(canned_response(exc))
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER_S, transport.close)

    def _report(self) -> None:
        if self.door.report_due():
            stats = self.door.statistics()
            log.warning(
                "front door refusing: %d connections open; refused or closed so far: %s",
                stats.open_connections,
                stats.refused,
            )


def front_door_protocol(door: DoorPolicy) -> type[FrontDoorProtocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`: every connection shares `door`."""
    return type("FrontDoorProtocol", (FrontDoorProtocol,), {"door": door})


class DoorCollector(Collector):
    """The front door's open connections and refusals, read from its policy at scrape time."""

    def __init__(self, door: DoorPolicy) -> None:
        self._door = door

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        stats = self._door.statistics()
        open_ = GaugeMetricFamily("inferd_frontdoor_connections", "Open HTTP connections (counted in).")
        open_.add_metric([], stats.open_connections)
        refused = CounterMetricFamily(
            "inferd_frontdoor_refused",
            "Requests and connections refused or cut off by the front door, by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(stats.refused.items()):
            refused.add_metric([reason], count)
        return [open_, refused]
