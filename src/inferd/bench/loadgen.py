"""The open-loop load generator: `run_load(spec) -> LoadReport`.

Every request has an intended send time fixed before the run (Poisson or constant arrivals). The
dispatcher starts each request at that time whatever the server is doing, and latency is measured from
the intended time, so a stalled server or a generator that falls behind shows up as latency instead of
as a quietly lower offered rate (no coordinated omission).

Each request carries a unique payload, and each answer is checked: the response id must be the id we
sent and OUTPUT0 must be `sim_digest(model_name, model_version, payload)`. An answer that fails either
check is `mismatched` (it belongs to another caller, or to nobody).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec
import numpy as np

from inferd.bench.report import LoadReport, PhaseReport, Recorder

Arrival = Literal["poisson", "constant"]

_PATH = "/v2/models/{model}/infer"
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
    """Most TCP connections open at once (aiohttp connector limit)."""
    grace_s: float = 1.0
    """Extra time after the last deadline before outstanding requests are cancelled."""
    slo_ms: float | None = None
    """When set, also report goodput: ok answers within this latency, per second."""

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


@dataclass
class _Run:
    """One run's moving parts, owned by `run_load`."""

    spec: LoadSpec
    session: aiohttp.ClientSession
    now: Callable[[], float]
    t0: float
    warmup: Recorder
    measured: Recorder
    checker: AnswerChecker = field(default_factory=AnswerChecker)
    sent: int = 0

    async def dispatch(self, offsets: list[float], tg: asyncio.TaskGroup) -> None:
        """Start each request at its intended time; never wait for answers before sending."""
        warmup_s = self.spec.warmup_s
        for i, offset in enumerate(offsets):
            intended = self.t0 + offset
            delay = intended - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            recorder = self.measured if offset >= warmup_s else self.warmup
            tg.create_task(self.one(i, intended, recorder))
            self.sent += 1

    async def one(self, i: int, intended: float, rec: Recorder) -> None:
        """Send request i, wait for its answer (deadline from the intended time), record the outcome."""
        spec = self.spec
        rid = request_id(spec.seed, i)
        payload = payload_for(spec.seed, i, spec.payload_bytes)
        deadline = intended + spec.timeout_ms / 1000.0
        rec.send_lag(self.now() - intended)
        self.checker.outstanding.add(rid)
        try:
            async with asyncio.timeout_at(deadline):
                await self._exchange(rid, payload, intended, deadline, rec)
        except TimeoutError:
            rec.error("timeout")
        except (aiohttp.ClientError, OSError):
            rec.error("connection")
        except asyncio.CancelledError:
            rec.error("timeout")  # the run's hard stop
            raise
        finally:
            self.checker.outstanding.discard(rid)

    async def _exchange(
        self, rid: str, payload: str, intended: float, deadline: float, rec: Recorder
    ) -> None:
        body = request_body(rid, payload)
        headers = self._headers(deadline)
        async with self.session.post(self.spec.endpoint, data=body, headers=headers) as resp:
            raw = await resp.read()
            latency = self.now() - intended
            if resp.status != 200:
                rec.error(f"http_{resp.status}")
                return
            verdict = self.checker.check(rid, payload, raw)
            if verdict == "ok":
                rec.ok(latency, resp.headers)
            elif verdict == "bad_response":
                rec.error(verdict)
            else:
                rec.mismatch(verdict)

    def _headers(self, deadline: float) -> Mapping[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.spec.priority is not None:
            headers["X-Priority"] = self.spec.priority
        if self.spec.send_deadline:
            remaining_ms = max(1, int((deadline - self.now()) * 1000.0))
            headers["X-Request-Timeout-Ms"] = str(remaining_ms)
        return headers


def _session(spec: LoadSpec) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=spec.connections, limit_per_host=0, ttl_dns_cache=None)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),  # deadlines are ours: asyncio.timeout_at per request
        skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
    )


async def run_load(spec: LoadSpec) -> LoadReport:
    """Offer `spec`'s load open-loop and return what happened in the measured window."""
    offsets = arrival_offsets(spec)
    loop = asyncio.get_running_loop()
    warmup = Recorder(slo_ms=spec.slo_ms)
    measured = Recorder(slo_ms=spec.slo_ms)
    cpu0 = time.process_time()
    async with _session(spec) as session:
        t0 = loop.time() + 0.01
        run = _Run(spec, session, loop.time, t0, warmup, measured)
        hard_stop = t0 + spec.total_s + spec.timeout_ms / 1000.0 + spec.grace_s
        try:
            async with asyncio.timeout_at(hard_stop), asyncio.TaskGroup() as tg:
                await run.dispatch(offsets, tg)
        except TimeoutError:
            pass  # outstanding requests were cancelled and counted as timeouts
        elapsed = loop.time() - t0
    return LoadReport(
        spec=spec_dict(spec),
        scheduled=len(offsets),
        sent=run.sent,
        elapsed_s=elapsed,
        generator_cpu_s=time.process_time() - cpu0,
        measured=PhaseReport.from_recorder(measured, spec.duration_s),
        warmup=PhaseReport.from_recorder(warmup, spec.warmup_s) if spec.warmup_s > 0 else None,
    )


def spec_dict(spec: LoadSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def run_load_blocking(spec: LoadSpec) -> LoadReport:
    """Run `run_load` on a fresh event loop (uvloop when installed)."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(run_load(spec))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
