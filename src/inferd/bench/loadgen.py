"""The open-loop load generator: `run_load(spec) -> LoadReport`.

Every request has an intended send time fixed before the run (Poisson or constant arrivals). The
dispatcher starts each request at that time whatever the server is doing, and latency is measured from
the intended time, so a stalled server or a generator that falls behind shows up as latency instead of
as a quietly lower offered rate (no coordinated omission).

Each request carries a unique payload, and each answer is checked: the response id must be the id we
sent and OUTPUT0 must be `sim_digest(model_name, model_version, payload)`. An answer that fails either
check is `mismatched` (it belongs to another caller, or to nobody).

Two HTTP clients carry the requests. The default, `raw`, is a lean HTTP/1.1 client written for this
generator: a pool of keep-alive asyncio connections, request bytes built in one formatting step, and
responses parsed by httptools, at a few tens of microseconds of CPU per request, so the generator can
offer thousands of requests per second while sharing the machine with the server it measures.
`aiohttp` (several times the CPU per request) is kept for comparison.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import aiohttp
import httptools
import msgspec
import numpy as np

from inferd.bench.chaos import ChaosAgent, ChaosSpec
from inferd.bench.report import LoadReport, PhaseReport, Recorder

Arrival = Literal["poisson", "constant"]
Client = Literal["raw", "aiohttp"]

_PATH = "/v2/models/{model}/infer"
_MIN_SLEEP_S = 0.001
"""Shortest dispatcher sleep: loop timers tick in milliseconds, and uvloop turns a shorter sleep into a
busy spin. A request due sooner waits for the next tick (its lag, like all lag, counts in latency)."""
_BODY_HEAD = b'{"id":"'
_BODY_MID = b'","inputs":[{"name":"INPUT0","shape":[1],"datatype":"BYTES","data":["'
_BODY_TAIL = b'"]}]}'


@dataclass(frozen=True)
class LoadSpec:
    """What to offer, to whom, and for how long."""

    url: str = "http://127.0.0.1:8000"
    model: str = "sim"
    rate: float = 100.0
    """Offered requests per second."""
    duration_s: float = 10.0
    """Length of the measured window."""
    warmup_s: float = 0.0
    """Load offered before the measured window; its results are reported apart."""
    arrival: Arrival = "poisson"
    timeout_ms: float = 5000.0
    """Client deadline per request, counted from its intended send time."""
    send_deadline: bool = False
    """Also send the remaining deadline as `X-Request-Timeout-Ms`."""
    priority: str | None = None
    """Sent as `X-Priority` when set."""
    payload_bytes: int = 32
    max_requests: int = 1_000_000
    seed: int = 0
    connections: int = 2000
    """Most TCP connections open at once; a request finding none idle and the limit reached waits."""
    grace_s: float = 1.0
    """Extra time after the last deadline before outstanding requests are cancelled."""
    slo_ms: float | None = None
    """When set, also report goodput: ok answers within this latency, per second."""
    client: Client = "raw"
    """HTTP client: 'raw' (lean keep-alive HTTP/1.1 over asyncio, plain http only) or 'aiohttp'."""

    def __post_init__(self) -> None:
        checks = {
            "rate must be > 0": self.rate > 0,
            "duration_s must be > 0": self.duration_s > 0,
            "warmup_s must be >= 0": self.warmup_s >= 0,
            "timeout_ms must be > 0": self.timeout_ms > 0,
            "max_requests must be >= 1": self.max_requests >= 1,
            "connections must be >= 1": self.connections >= 1,
            "payload_bytes must be >= 0": self.payload_bytes >= 0,
            "grace_s must be >= 0": self.grace_s >= 0,
            "arrival must be 'poisson' or 'constant'": self.arrival in ("poisson", "constant"),
            "client must be 'raw' or 'aiohttp'": self.client in ("raw", "aiohttp"),
            "the raw client needs an http:// url with a host": self.client != "raw"
            or _is_plain_http(self.url),
        }
        failed = [msg for msg, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"invalid LoadSpec ({'; '.join(failed)}): {self}")

    @property
    def total_s(self) -> float:
        return self.warmup_s + self.duration_s

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + _PATH.format(model=self.model)


def _is_plain_http(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError on a malformed port
    except ValueError:
        return False
    return parts.scheme == "http" and bool(parts.hostname)


def request_id(seed: int, i: int) -> str:
    return f"{seed}-{i}"


def payload_for(seed: int, i: int, payload_bytes: int) -> str:
    """Unique per request: `"{seed}-{i}-"` padded with 'x' to `payload_bytes` (never truncated)."""
    return f"{seed}-{i}-".ljust(payload_bytes, "x")


def request_body(rid: str, payload: str) -> bytes:
    """The OIP v2 JSON body for one BYTES input (ids and payloads are JSON-safe by construction)."""
    return b"".join((_BODY_HEAD, rid.encode(), _BODY_MID, payload.encode(), _BODY_TAIL))


def arrival_offsets(spec: LoadSpec) -> list[float]:
    """Intended send times in seconds from the start, over warmup + duration, at most max_requests."""
    total = spec.total_s
    if spec.arrival == "constant":
        n = min(spec.max_requests, math.ceil(total * spec.rate))
        return [i / spec.rate for i in range(n)]
    rng = np.random.default_rng(spec.seed)
    expected = total * spec.rate
    chunk = int(expected + 6 * math.sqrt(expected) + 16)
    times = np.cumsum(rng.exponential(1.0 / spec.rate, size=chunk))
    while times[-1] < total and times.size < spec.max_requests:
        more = np.cumsum(rng.exponential(1.0 / spec.rate, size=chunk)) + times[-1]
        times = np.concatenate((times, more))
    times = times[times < total][: spec.max_requests]
    return times.tolist()


class _Output(msgspec.Struct):
    data: list[Any] = []


class _InferResponse(msgspec.Struct):
    id: str | None = None
    model_name: str = ""
    model_version: str | int = "1"
    outputs: list[_Output] = []


class AnswerChecker:
    """Decides whether a 200 answer is ours: right id, right digest; remembers outstanding ids."""

    def __init__(self) -> None:
        self.outstanding: set[str] = set()
        self._decoder = msgspec.json.Decoder(_InferResponse)
        self._prefixes: dict[tuple[str, str], bytes] = {}

    def check(self, rid: str, payload: str, raw: bytes) -> str:
        """'ok', 'wrong_id', 'unknown_id' (id not outstanding), 'wrong_digest' or 'bad_response'."""
        try:
            resp = self._decoder.decode(raw)
            digest = resp.outputs[0].data[0]
        except (msgspec.DecodeError, IndexError):
            return "bad_response"
        if resp.id != rid:
            return "wrong_id" if resp.id in self.outstanding else "unknown_id"
        try:
            expected = self._expected(resp.model_name, str(resp.model_version), payload)
        except ValueError:  # model_version is not an integer
            return "bad_response"
        return "ok" if digest == expected else "wrong_digest"

    def _expected(self, model: str, version: str, payload: str) -> str:
        prefix = self._prefixes.get((model, version))
        if prefix is None:
            prefix = f"{model}:{int(version)}:".encode()
            self._prefixes[(model, version)] = prefix
        return hashlib.sha256(prefix + payload.encode()).hexdigest()[:32]


# --- HTTP clients: post(body, deadline) -> (status, headers, body) ---

Answer = tuple[int, Mapping[str, str], bytes]


class HttpClient(Protocol):
    """What the engine needs from an HTTP client. Connection failures raise OSError or aiohttp.ClientError;
    the caller bounds each call with its deadline (cancellation) and counts that as a timeout."""

    async def start(self) -> None: ...

    async def post(self, body: bytes, deadline: float) -> Answer: ...

    async def close(self) -> None: ...


def _extra_headers(spec: LoadSpec) -> dict[str, str]:
    return {"X-Priority": spec.priority} if spec.priority is not None else {}


class AiohttpClient:
    """The aiohttp client: general and well tested, but ~250 us of CPU per request."""

    def __init__(self, spec: LoadSpec, now: Callable[[], float]) -> None:
        self._endpoint = spec.endpoint
        self._send_deadline = spec.send_deadline
        self._headers = {"Content-Type": "application/json"} | _extra_headers(spec)
        self._now = now
        connector = aiohttp.TCPConnector(limit=spec.connections, limit_per_host=0, ttl_dns_cache=None)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),  # deadlines are the caller's
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
        )

    async def start(self) -> None:
        pass

    async def post(self, body: bytes, deadline: float) -> Answer:
        headers = self._headers
        if self._send_deadline:
            remaining_ms = max(1, int((deadline - self._now()) * 1000.0))
            headers = headers | {"X-Request-Timeout-Ms": str(remaining_ms)}
        async with self._session.post(self._endpoint, data=body, headers=headers) as resp:
            return resp.status, resp.headers, await resp.read()

    async def close(self) -> None:
        await self._session.close()


class HttpProtocolError(ConnectionError):
    """The server sent bytes that are not a valid HTTP/1.1 response, or sent them unasked."""


# Response headers the engine reads, by lower-cased name, mapped to the spelling `Recorder` looks up.
_WANTED_HEADERS = {
    name.lower().encode(): name
    for name in (
        "X-Inferd-Queue-Ms",
        "X-Inferd-Compute-Ms",
        "X-Inferd-Batch-Size",
        "X-Inferd-Attempts",
        "Retry-After",
    )
}
_FRAMING_HEADERS = frozenset((b"content-length", b"transfer-encoding"))


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time, parsed by httptools."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[Answer] | None = None
        self._status = 0
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._framed = False
        self._headers_done = False
        self.closed = False
        """Set on EOF, loss, error or abort: never hand this connection out again."""
        self.keep_alive = True
        """After an answer: whether the server lets the connection carry another request."""

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: this connection can't be trusted
            self.abort()
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(HttpProtocolError(f"bad HTTP response: {exc}"))

    def eof_received(self) -> bool:
        self.closed = True
        return False  # let the transport close; connection_lost settles any pending answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if exc is None and self._headers_done and not self._framed:
            # No Content-Length and not chunked: the body ran to the end of the connection.
            self._waiter = None
            self.keep_alive = False
            waiter.set_result((self._status, self._headers, b"".join(self._body)))
        else:
            self._fail(exc or ConnectionResetError("connection closed before a complete response"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._status = 0
        self._headers = {}
        self._body = []
        self._framed = False
        self._headers_done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        key = _WANTED_HEADERS.get(lname)
        if key is not None:
            self._headers[key] = value.decode("latin-1")
        elif lname in _FRAMING_HEADERS:
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        waiter = self._waiter
        self._waiter = None
        self.keep_alive = self._parser.should_keep_alive()
        if waiter is not None and not waiter.done():
            body = self._body
            waiter.set_result((self._status, self._headers, body[0] if len(body) == 1 else b"".join(body)))

    # for the pool
    def request(self, data: bytes) -> asyncio.Future[Answer]:
        """Send one complete request; the future resolves with its answer (or the connection's failure)."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        self._transport.write(data)  # type: ignore[union-attr]
        return waiter

    def abort(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    def _fail(self, exc: BaseException) -> None:
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.abort()


class RawClient:
    """A lean HTTP/1.1 client for one host: a pool of keep-alive connections, one request per connection
    at a time (no pipelining), pre-built request bytes, httptools parsing.

    A request takes the most recently idle connection, else opens a new one while fewer than
    `connections` are open, else waits (FIFO) for one to come back. A connection is discarded when the
    server asks to close it, when it fails, and when its request is cancelled (deadline or hard stop) with
    the answer still pending, so a late answer can never be read as the next request's.
    """

    def __init__(self, spec: LoadSpec, now: Callable[[], float]) -> None:
        parts = urlsplit(spec.endpoint)
        self._host = parts.hostname or ""
        self._port = parts.port or 80
        self._limit = spec.connections
        self._prewarm = min(spec.connections, 64, max(1, math.ceil(spec.rate / 500.0)))
        self._connect_wait_s = min(1.0, spec.timeout_ms / 1000.0)
        self._send_deadline = spec.send_deadline
        self._now = now
        head = f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in _extra_headers(spec).items())
        self._head = head.encode("latin-1")
        self._loop = asyncio.get_running_loop()
        self._idle: deque[_Connection] = deque()
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self._all: set[_Connection] = set()
        self._open = 0
        """Connections open or being opened, against the limit."""

    def build(self, body: bytes, deadline: float) -> bytes:
        """The whole request: request line, headers and body, in one bytes object."""
        if self._send_deadline:
            remaining_ms = max(1, int((deadline - self._now()) * 1000.0))
            return b"%sX-Request-Timeout-Ms: %d\r\nContent-Length: %d\r\n\r\n%s" % (
                self._head,
                remaining_ms,
                len(body),
                body,
            )
        return b"%sContent-Length: %d\r\n\r\n%s" % (self._head, len(body), body)

    async def start(self) -> None:
        """Open a few connections before the first request: 2 ms of the offered rate, at most 64."""
        connects = [asyncio.ensure_future(self._connect()) for _ in range(self._prewarm)]
        await asyncio.wait(connects, timeout=self._connect_wait_s)
        for connect in connects:
            if not connect.done():
                connect.cancel()
                continue
            exc = connect.exception()
            if exc is None:
                self._open += 1
                self._idle.append(connect.result())
            elif not isinstance(exc, OSError):  # refused etc. show up per request; others are bugs
                raise exc
        if any(not c.done() for c in connects):
            await asyncio.wait(connects)  # let the cancelled ones finish unwinding

    async def post(self, body: bytes, deadline: float) -> Answer:
        conn = await self._acquire()
        reuse = False
        try:
            answer = await conn.request(self.build(body, deadline))
            reuse = conn.keep_alive
            return answer
        finally:
            self._release(conn, reuse)

    async def close(self) -> None:
        for conn in self._all:
            conn.abort()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost callbacks run

    async def _acquire(self) -> _Connection:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
            self._discard(conn)
            self._open -= 1
        if self._open < self._limit:
            self._open += 1
        else:
            waiter: asyncio.Future[_Connection | None] = self._loop.create_future()
            self._waiters.append(waiter)
            try:
                handed = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # handed over just as we were cancelled
                    conn_or_slot = waiter.result()
                    if conn_or_slot is None:
                        self._free_slot()
                    else:
                        self._release(conn_or_slot, True)
                raise
            if handed is not None:
                return handed
            # None: a slot was freed and counted as ours; open a connection in it.
        try:
            return await self._connect()
        except BaseException:
            self._free_slot()
            raise

    async def _connect(self) -> _Connection:
        loop = self._loop
        _, conn = await loop.create_connection(lambda: _Connection(loop), self._host, self._port)
        self._all.add(conn)
        return conn

    def _release(self, conn: _Connection, reuse: bool) -> None:
        if reuse and not conn.closed:
            waiters = self._waiters
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(conn)
                    return
            self._idle.append(conn)
            return
        conn.abort()
        self._discard(conn)
        self._free_slot()

    def _discard(self, conn: _Connection) -> None:
        self._all.discard(conn)

    def _free_slot(self) -> None:
        """A connection is gone: give its slot to the first live waiter, else shrink the count."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._open -= 1


def make_client(spec: LoadSpec, now: Callable[[], float]) -> HttpClient:
    """The client `spec.client` names; call from inside the running loop."""
    if spec.client == "aiohttp":
        return AiohttpClient(spec, now)
    return RawClient(spec, now)


@dataclass
class _Run:
    """One run's moving parts, owned by `run_load`."""

    spec: LoadSpec
    client: HttpClient
    now: Callable[[], float]
    t0: float
    warmup: Recorder
    measured: Recorder
    loop_skew: float = 0.0
    """The loop's clock minus `now`, for deadlines given to the loop."""
    checker: AnswerChecker = field(default_factory=AnswerChecker)
    sent: int = 0
    results: list[float] = field(default_factory=list)
    """Per request number: latency (s) when ok, -1.0 when sent but not ok, NaN while unsent."""

    async def dispatch(self, offsets: list[float], tg: asyncio.TaskGroup) -> None:
        """Start each request at its intended time; never wait for answers before sending."""
        warmup_s = self.spec.warmup_s
        now = self.now
        for i, offset in enumerate(offsets):
            intended = self.t0 + offset
            while (delay := intended - now()) > 0:  # noqa: ASYNC110 -- a timer may fire early
                await asyncio.sleep(delay if delay > _MIN_SLEEP_S else _MIN_SLEEP_S)
            recorder = self.measured if offset >= warmup_s else self.warmup
            tg.create_task(self.one(i, intended, recorder))
            self.sent += 1

    async def one(self, i: int, intended: float, rec: Recorder) -> None:
        """Send request i, wait for its answer (deadline from the intended time), record the outcome."""
        spec = self.spec
        rid = request_id(spec.seed, i)
        payload = payload_for(spec.seed, i, spec.payload_bytes)
        deadline = intended + spec.timeout_ms / 1000.0
        lag = self.now() - intended
        rec.send_lag(lag)
        self.results[i] = -1.0
        self.checker.outstanding.add(rid)
        try:
            async with asyncio.timeout_at(deadline + self.loop_skew):
                status, headers, raw = await self.client.post(request_body(rid, payload), deadline)
        except TimeoutError:
            rec.error("timeout")
        except (aiohttp.ClientError, OSError):
            rec.error("connection")
        except asyncio.CancelledError:
            rec.error("timeout")  # the run's hard stop
            raise
        else:
            latency = self.now() - intended
            if status != 200:
                rec.error(f"http_{status}", latency)
                return
            verdict = self.checker.check(rid, payload, raw)
            if verdict == "ok":
                rec.ok(latency, headers, lag)
                self.results[i] = latency
            elif verdict == "bad_response":
                rec.error(verdict)
            else:
                rec.mismatch(verdict)
        finally:
            self.checker.outstanding.discard(rid)


async def run_load(spec: LoadSpec, chaos: ChaosSpec | None = None) -> LoadReport:
    """Offer `spec`'s load open-loop and return what happened in the measured window.

    With an enabled `chaos`, a `ChaosAgent` signals workers of `spec.model` on the same loop during the
    measured window; it is always cleaned up (every stopped pid resumed), whatever happens to the run."""
    offsets = arrival_offsets(spec)
    loop = asyncio.get_running_loop()
    warmup = Recorder(slo_ms=spec.slo_ms)
    measured = Recorder(slo_ms=spec.slo_ms)
    cpu0 = time.process_time()
    # The clock for intended times, latencies and lags. Not loop.time(): uvloop's is in whole milliseconds
    # and cached per loop iteration. Deadlines go to the loop's timers shifted by the (tiny) skew.
    now = time.monotonic
    client = make_client(spec, now)
    agent = ChaosAgent(chaos, spec.model, now) if chaos is not None and chaos.enabled else None
    try:
        await client.start()
        t0 = now() + 0.01
        skew = loop.time() - now()
        run = _Run(spec, client, now, t0, warmup, measured, loop_skew=skew)
        run.results = [math.nan] * len(offsets)
        hard_stop = t0 + spec.total_s + spec.timeout_ms / 1000.0 + spec.grace_s
        if agent is not None:
            agent.start(window_start=t0 + spec.warmup_s, window_end=t0 + spec.total_s)
        try:
            async with asyncio.timeout_at(hard_stop + skew), asyncio.TaskGroup() as tg:
                await run.dispatch(offsets, tg)
        except TimeoutError:
            pass  # outstanding requests were cancelled and counted as timeouts
        elapsed = now() - t0
        if agent is not None:
            await agent.finish()
    finally:
        if agent is not None:
            await agent.close()
        await client.close()
    chaos_report = None
    if agent is not None:
        first = bisect.bisect_left(offsets, spec.warmup_s)
        rel = np.asarray(offsets[first:], dtype=float) - spec.warmup_s
        chaos_report = agent.report(rel, np.asarray(run.results[first:], dtype=float), spec.duration_s)
    return LoadReport(
        spec=spec_dict(spec),
        scheduled=len(offsets),
        sent=run.sent,
        elapsed_s=elapsed,
        generator_cpu_s=time.process_time() - cpu0,
        measured=PhaseReport.from_recorder(measured, spec.duration_s),
        warmup=PhaseReport.from_recorder(warmup, spec.warmup_s) if spec.warmup_s > 0 else None,
        chaos=chaos_report,
    )


def spec_dict(spec: LoadSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def run_load_blocking(spec: LoadSpec, chaos: ChaosSpec | None = None) -> LoadReport:
    """Run `run_load` on a fresh event loop (uvloop when installed)."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(run_load(spec, chaos))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
