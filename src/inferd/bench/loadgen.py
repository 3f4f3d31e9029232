"""The open-loop load generator: `run_load(spec) -> LoadReport`.

Every request has an intended send time fixed before the run (Poisson or constant arrivals, see
`inferd.bench.open_loop`). The dispatcher starts each request at that time whatever the server is doing,
and latency is measured from the intended time, so a stalled server or a generator that falls behind
shows up as latency instead of as a quietly lower offered rate (no coordinated omission).

Each request carries a unique payload, and each answer is checked (`inferd.bench.infer_requests`): the
response id must be the id we sent and OUTPUT0 must be `sim_digest(model_name, model_version, payload)`.
Requests travel over the protocol `spec.protocol` names (`inferd.bench.infer_transport`): OIP v2 JSON
over the HTTP client `spec.client` names, or Triton's gRPC ModelInfer.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from inferd.bench.chaos import ChaosAgent
from inferd.bench.chaos_spec import ChaosSpec
from inferd.bench.infer_requests import AnswerChecker, payload_for, request_id
from inferd.bench.infer_transport import InferTransport, make_transport
from inferd.bench.load_spec import LoadSpec
from inferd.bench.open_loop import arrival_offsets, run_blocking, sleep_until
from inferd.bench.report import LoadReport, PhaseReport, Recorder

RecorderFor = Callable[[int, float], Recorder]
"""The recorder of request i, given i and its intended offset from the start of the run."""


@dataclass(frozen=True)
class OfferedLoad:
    """What `offer_load` did."""

    t0: float
    """The intended time of offset 0, on the `time.monotonic` clock."""
    sent: int
    elapsed_s: float
    """From t0 until every request was answered or the hard stop."""
    results: list[float]
    """Per request number: latency (s) when ok, -1.0 when sent but not ok, NaN when never sent."""


@dataclass
class _Run:
    """One run's moving parts, owned by `offer_load`."""

    spec: LoadSpec
    client: InferTransport
    now: Callable[[], float]
    t0: float
    checker: AnswerChecker
    loop_skew: float = 0.0
    """The loop's clock minus `now`, for deadlines given to the loop."""
    sent: int = 0
    results: list[float] = field(default_factory=list)

    async def dispatch(self, offsets: list[float], recorder_for: RecorderFor, tg: asyncio.TaskGroup) -> None:
        """Start each request at its intended time; never wait for answers before sending."""
        now = self.now
        for i, offset in enumerate(offsets):
            intended = self.t0 + offset
            await sleep_until(intended, now)
            tg.create_task(self.one(i, intended, recorder_for(i, offset)))
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
                failed, headers, raw = await self.client.send(rid, payload, deadline)
        except TimeoutError:
            rec.error("timeout")
        except (aiohttp.ClientError, OSError):
            rec.error("connection")
        except asyncio.CancelledError:
            rec.error("timeout")  # the run's hard stop
            raise
        else:
            latency = self.now() - intended
            if failed is not None:
                rec.error(failed, latency)
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


async def offer_load(
    spec: LoadSpec,
    offsets: list[float],
    recorder_for: RecorderFor,
    on_start: Callable[[float], None] | None = None,
) -> OfferedLoad:
    """Send request i at t0 + offsets[i] over one transport of `spec`, whatever the server is doing,
    and record each outcome in `recorder_for(i, offsets[i])`. `on_start(t0)` runs once t0 is fixed,
    before the first send. Returns once every request is answered or `spec.hard_stop_s` has passed."""
    loop = asyncio.get_running_loop()
    # The clock for intended times, latencies and lags. Not loop.time(): uvloop's is in whole milliseconds
    # and cached per loop iteration. Deadlines go to the loop's timers shifted by the (tiny) skew.
    now = time.monotonic
    client = make_transport(spec, now)
    try:
        await client.start()
        t0 = now() + 0.01
        run = _Run(spec, client, now, t0, AnswerChecker(client.fields), loop_skew=loop.time() - now())
        run.results = [math.nan] * len(offsets)
        if on_start is not None:
            on_start(t0)
        try:
            async with asyncio.timeout_at(t0 + spec.hard_stop_s + run.loop_skew), asyncio.TaskGroup() as tg:
                await run.dispatch(offsets, recorder_for, tg)
        except TimeoutError:
            pass  # outstanding requests were cancelled and counted as timeouts
        elapsed = now() - t0
    finally:
        await client.close()
    return OfferedLoad(t0=t0, sent=run.sent, elapsed_s=elapsed, results=run.results)


async def run_load(spec: LoadSpec, chaos: ChaosSpec | None = None) -> LoadReport:
    """Offer `spec`'s load open-loop and return what happened in the measured window.

    With an enabled `chaos`, a `ChaosAgent` signals workers of `spec.model` on the same loop during the
    measured window; it is always cleaned up (every stopped pid resumed), whatever happens to the run."""
    offsets = arrival_offsets(spec)
    warmup = Recorder(slo_ms=spec.slo_ms)
    measured = Recorder(slo_ms=spec.slo_ms)
    cpu0 = time.process_time()
    agent = ChaosAgent(chaos, spec.model, time.monotonic) if chaos is not None and chaos.enabled else None

    def recorder_for(i: int, offset: float) -> Recorder:
        return measured if offset >= spec.warmup_s else warmup

    def start_chaos(t0: float) -> None:
        if agent is not None:
            agent.start(window_start=t0 + spec.warmup_s, window_end=t0 + spec.total_s)

    try:
        offered = await offer_load(spec, offsets, recorder_for, on_start=start_chaos)
        if agent is not None:
            await agent.finish()
    finally:
        if agent is not None:
            await agent.close()
    chaos_report = None
    if agent is not None:
        first = bisect.bisect_left(offsets, spec.warmup_s)
        rel = np.asarray(offsets[first:], dtype=float) - spec.warmup_s
        chaos_report = agent.report(rel, np.asarray(offered.results[first:], dtype=float), spec.duration_s)
    return LoadReport(
        spec=spec_dict(spec),
        scheduled=len(offsets),
        sent=offered.sent,
        elapsed_s=offered.elapsed_s,
        generator_cpu_s=time.process_time() - cpu0,
        measured=PhaseReport.from_recorder(measured, spec.duration_s),
        warmup=PhaseReport.from_recorder(warmup, spec.warmup_s) if spec.warmup_s > 0 else None,
        chaos=chaos_report,
    )


def spec_dict(spec: LoadSpec) -> dict[str, Any]:
    """The spec as the report shows it: extra headers by name only (their values may be API keys)."""
    shown = {name: getattr(spec, name) for name in spec.__dataclass_fields__}
    shown["headers"] = [name for name, _ in spec.headers]
    return shown


def run_load_blocking(spec: LoadSpec, chaos: ChaosSpec | None = None) -> LoadReport:
    """Run `run_load` on a fresh event loop (uvloop when installed)."""
    return run_blocking(run_load(spec, chaos))
