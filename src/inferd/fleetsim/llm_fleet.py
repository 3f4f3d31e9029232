"""A fleet of LLM devices behind one or more front ends, simulated on a virtual clock, token by token.

Each front end is inferd's own `LLMRuntime` (kinds/llm/runtime.py) as the server builds it: its placement and
admission (kinds/llm/placement.py), prefix-aware routing (kinds/llm/routing.py), token streams, deadlines, hang
watchdog and failover run unchanged. Each device (llm_device.py) is inferd's own engine (kinds/llm/engine.py
`LLMEngine`: its receive / apply / post steps) around inferd's own continuous-batching scheduler and KV
cache (kinds/llm/scheduler.py, kinds/llm/kv.py), fed the real wire messages: the runtime's AddSequence and
AbortSequence frames are decoded off the device's WorkerConnection, and each step's StepDeltas go back to the
runtime's `on_message`. Only the edges are simulated:
- the model: each step's tokens come back after the profile's step cost (llm_profile.LLMProfile),
  with one sampled token per sampling chunk and no early stop (like sim-llm with ignore_eos);
- the front end's CPU is a FIFO server taking `frontend_s` per request; the first token and the end
  of each stream get the profile's `overhead_s` (HTTP, IPC).

Front ends split the arrivals round-robin. Every device serves every front end, as the workers of
`inferd serve --frontends N` and `inferd worker --connect a,b,...` do (llm_links.py: inferd's own
SequenceOwners between the engine and each front end's link), or, with `shared_devices=False`, each has
its own share of the devices (device d is front end d % F's). One front end has the devices to itself.
A device the hang watchdog kills stays down, for every front end (no failures are injected here).

`LLMRuntime.submit` creates asyncio events in token streams, so `run` is called inside a running event
loop (`simulate_llm` does that); nothing awaits them and no task runs.
"""

from __future__ import annotations

import asyncio
import gc
import math
from dataclasses import dataclass, field

import numpy as np

from inferd.clock import FakeClock
from inferd.errors import Overloaded, ServingError
from inferd.fleetsim.events import EventQueue
from inferd.fleetsim.llm_device import CostModelLLM, DeviceLoop, SimLLMDevice
from inferd.fleetsim.llm_links import SharedLLMDevice
from inferd.fleetsim.llm_profile import LLMProfile
from inferd.fleetsim.llm_report import GapHistogram, LLMOutcome, LLMSimReport, build_report
from inferd.kinds.llm.params import llm_params
from inferd.kinds.llm.placement import Generation
from inferd.kinds.llm.plan import StepPlan
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.sim_llm import sim_llm_config
from inferd.kinds.llm.stream import TokenStream
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection

GC_THRESHOLDS = (100_000, 50, 100)
"""The cyclic collector's thresholds while a fleet runs (restored after): it allocates millions of
short-lived objects; with the default young-generation pass every 700 of them, a 100-device run took
12% longer (benchmarks/llm_fleet_scale.py 100 20, both run side by side)."""
WATCHDOG_EVERY_S = 0.1
"""How often each runtime's watchdog runs (deadlines, hung workers), as the server's does."""
_FILLER = [1 + i % 250 for i in range(1 << 17)]
"""Prompt tokens other than each request's unique one (a longer prompt builds its own)."""


@dataclass(slots=True)
class LLMFleetSpec:
    profile: LLMProfile
    devices: int
    arrivals: np.ndarray
    """Intended request times, seconds from the start."""
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    """Per request: prompt length and max_tokens (every stream generates exactly that many)."""
    frontends: int = 1
    warmup_s: float = 0.0
    slo: dict[str, float] = field(default_factory=lambda: {"ttft_ms": 1500.0, "itl_ms": 150.0})
    shared_prefix_tokens: int = 0
    """Leading prompt tokens every request shares (a system prompt): exercises prefix caching."""
    timeout_s: float | None = None
    """Each sequence's deadline (Generation.deadline), from its submission; None: none."""
    drain_s: float = 60.0
    """Virtual seconds after the last arrival for streams to finish."""
    seed: int = 0
    shared_devices: bool = True
    """With several front ends: every device serves every front end (each front end's placement sees
    only its own sequences on it); False: device d is front end d % frontends' alone."""


class _Track:
    """One live stream as its client sees it; written back to the fleet's per-request lists when it
    ends (one small object per token's lookups instead of five long lists). The fleet keeps them per
    front end, by that front end's sequence id (two front ends' ids never meet)."""

    __slots__ = ("last_at", "measured", "over", "rid", "stream", "tokens")

    def __init__(self, rid: int, stream: TokenStream, measured: bool) -> None:
        self.rid = rid
        self.stream = stream
        self.measured = measured
        self.tokens = 0
        self.over = 0
        self.last_at = math.nan


class LLMFleet:
    def __init__(self, spec: LLMFleetSpec) -> None:
        self.spec = spec
        self.profile = spec.profile
        self.clock = FakeClock(0.0)
        self.events = EventQueue(self.clock)
        self.config = sim_llm_config(name="llm", params=spec.profile.model_params())
        self.model_name = self.config.name
        self.scheduler_config = llm_params(self.config).scheduler
        self.model = CostModelLLM(self.config)
        rng = np.random.default_rng(spec.seed)
        self._noise = (1.0 + spec.profile.jitter_cv * rng.standard_normal(1 << 16)).clip(0.05).tolist()
        self._noise_at = 0
        n = spec.arrivals.size
        self.first_at = [math.nan] * n
        self.last_at = [math.nan] * n
        self.tokens = [0] * n
        self.over = [0] * n
        self.outcome = [int(LLMOutcome.PENDING)] * n
        self.measured = (spec.arrivals >= spec.warmup_s).tolist()
        self.gaps = GapHistogram()
        self.live: list[dict[str, _Track]] = [{} for _ in range(spec.frontends)]
        """Streams not yet ended, per front end, by that front end's sequence id."""
        self.steps = 0
        self.step_tokens = 0
        self.step_seconds = 0.0
        self.itl_slo_s = spec.slo["itl_ms"] / 1000
        self.frontends = [self._runtime() for _ in range(spec.frontends)]
        self.fe_free_at = [0.0] * spec.frontends
        self.devices: list[DeviceLoop] = [self._device(d) for d in range(spec.devices)]
        self._device_of: dict[WorkerConnection, DeviceLoop] = {}
        for device in self.devices:
            for runtime, conn in device.connections():
                runtime.add_worker(conn)
                self._device_of[conn] = device
        self.connections = list(self._device_of)
        """Every (device, front end) connection."""

    def _runtime(self) -> LLMRuntime:
        return LLMRuntime(
            self.config, self.clock, None, RetryBudget(self.clock, 0.1, 10.0), kill_worker=self._kill_hung
        )

    def _device(self, d: int) -> DeviceLoop:
        worker_id = f"llm-{d}.0"
        if self.spec.shared_devices and len(self.frontends) > 1:
            return SharedLLMDevice(self, worker_id, self.frontends, self.live)
        fe = d % len(self.frontends)
        return SimLLMDevice(self, worker_id, self.frontends[fe], self.live[fe])

    def _kill_hung(self, conn: WorkerConnection) -> None:
        """A front end's watchdog killed the worker: it is gone for every front end it served."""
        device = self._device_of[conn]
        if not device.dead:
            device.kill("killed by the watchdog")

    # ---- the device cost model --------------------------------------------------------------------
    def step_cost(self, plan: StepPlan) -> float:
        tokens = 0
        context = 0
        for c in plan.chunks:
            n = len(c.token_ids)
            tokens += n
            context += c.start + n
        cost = self.profile.step_s(tokens, context)
        if self.profile.jitter_cv:
            self._noise_at = (self._noise_at + 1) & 0xFFFF
            cost *= self._noise[self._noise_at]
        self.steps += 1
        self.step_tokens += tokens
        self.step_seconds += cost
        return cost

    # ---- requests -----------------------------------------------------------------------------------
    def prompt(self, rid: int) -> list[int]:
        """The shared prefix, then a token no other request has, then filler. Block names chain, so
        every block from the unique token on is this request's alone. Filler and prefix are small ints
        (CPython's cached ones): 25,000 live prompts of 500 tokens then hold no int objects of their own."""
        n = int(self.spec.prompt_tokens[rid])
        shared = min(self.spec.shared_prefix_tokens, n - 1)
        filler = _FILLER if n <= len(_FILLER) else [1 + i % 250 for i in range(n)]
        return [*filler[:shared], (rid + 1) << 20, *filler[shared + 1 : n]]

    def arrive(self, rid: int) -> None:
        spec = self.spec
        if rid + 1 < spec.arrivals.size:
            self.events.at(float(spec.arrivals[rid + 1]), self.arrive, rid + 1)
        fe = rid % len(self.frontends)
        now = self.clock.now()
        start = max(now, self.fe_free_at[fe])
        self.fe_free_at[fe] = start + self.profile.frontend_s
        self.events.at(self.fe_free_at[fe], self.submit, fe, rid)

    def submit(self, fe: int, rid: int) -> None:
        runtime = self.frontends[fe]
        now = self.clock.now()
        timeout = self.spec.timeout_s
        gen = Generation(
            max_tokens=int(self.spec.output_tokens[rid]),
            ignore_eos=True,
            deadline=None if timeout is None else now + timeout,
        )
        try:
            stream = runtime.submit(self.prompt(rid), gen)
        except ServingError as exc:
            self.outcome[rid] = LLMOutcome.REJECTED if isinstance(exc, Overloaded) else LLMOutcome.FAILED
            return
        self.live[fe][stream.seq_id] = _Track(rid, stream, self.measured[rid])

    def observe(self, msg: p.StepDeltas, live: dict[str, _Track]) -> None:
        """Each stream's tokens as its client sees them (TTFT, gaps, the end); `live`: the streams of
        the front end that received `msg`."""
        now = self.clock.now()
        slo = self.itl_slo_s
        first_at, gaps = self.first_at, self.gaps.buffer
        for seq_id in msg.decoded_ids:  # one token each, none ends
            t = live.get(seq_id)
            if t is None:
                continue
            if t.tokens:
                gap = now - t.last_at
                if gap > slo:
                    t.over += 1
                if t.measured:
                    gaps.append(gap)
            else:
                first_at[t.rid] = now
            t.last_at = now
            t.tokens += 1
        for delta in msg.deltas:
            t = live.get(delta.seq_id)
            if t is None:
                continue
            if delta.token_ids:
                if t.tokens:
                    gap = now - t.last_at
                    t.over += gap > slo
                    if t.measured:
                        gaps.append(gap)
                else:
                    first_at[t.rid] = now
                t.last_at = now
                t.tokens += len(delta.token_ids)
            if t.stream.ended:
                self._end(t, delta.error is None and delta.finish_reason in ("length", "stop"), live)
        if len(gaps) > 1_000_000:
            self.gaps.flush()

    def _end(self, t: _Track, ok: bool, live: dict[str, _Track]) -> None:
        self.outcome[t.rid] = LLMOutcome.OK if ok else LLMOutcome.FAILED
        del live[t.stream.seq_id]
        self._write_back(t)

    def _write_back(self, t: _Track) -> None:
        self.tokens[t.rid], self.last_at[t.rid], self.over[t.rid] = t.tokens, t.last_at, t.over

    def watchdog(self) -> None:
        now = self.clock.now()
        for conn in self.connections:
            conn.last_heartbeat = now
        for runtime in self.frontends:
            runtime.expire_deadlines()
            runtime.check_workers()
        self.events.at(now + WATCHDOG_EVERY_S, self.watchdog)

    def preemptions(self) -> int:
        return sum(d.scheduler.statistics().preemptions for d in self.devices)

    # ---- running --------------------------------------------------------------------------------------
    def run(self) -> LLMSimReport:
        spec = self.spec
        end = float(spec.arrivals[-1]) if spec.arrivals.size else 0.0
        if spec.arrivals.size:
            self.events.at(float(spec.arrivals[0]), self.arrive, 0)
        self.events.at(0.0, self.watchdog)
        thresholds = gc.get_threshold()
        gc.set_threshold(*GC_THRESHOLDS)
        try:
            self.events.run_until(end + spec.drain_s)
        finally:
            gc.set_threshold(*thresholds)
        for live in self.live:
            for t in list(live.values()):
                if t.stream.ended:  # failed without a delta: deadline, lost, displaced
                    self._end(t, False, live)
                else:
                    self._write_back(t)
        return build_report(self, spec.warmup_s, end)


def simulate_llm(spec: LLMFleetSpec) -> LLMSimReport:
    """Run the fleet inside a private event loop (the runtime creates events; no task ever runs)."""

    async def main() -> LLMSimReport:
        return LLMFleet(spec).run()

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
