"""Chaos injection for `inferd bench`: signal worker processes while the load runs, and time recovery.

Every `interval_s` of the measured window (first after `start_s`), the agent lists the workers through the
admin API (`GET {admin}/admin/workers`), picks one at random among the benchmarked model's workers that
are `ready` and run on this machine (`host == socket.gethostname()`), and sends it SIGKILL (`kill`) or
SIGSTOP (`stop`). After each injection it polls the admin API every `poll_s` (at most
`measure_timeout_s`) and records:

- time to detect: until the victim (its worker_id with its pid) is no longer listed as `ready`;
- time to replace: from the injection until, after detection, the model again has as many `ready` workers
  as it had just before the injection.

Injections keep to their schedule even while an earlier one is still being measured; one poll loop serves
every pending measurement (at most one admin request per `poll_s`). A pid is signalled at most once. Every
pid the agent stopped is sent SIGCONT at the end (normal or not), so no process is ever left stopped by the
tool; for `stop` the server's hang watchdog is what kills and replaces the stopped worker.

Everything runs on the load generator's event loop: admin calls are aiohttp requests with a short timeout,
and signals are `os.kill` (non-blocking).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import numpy as np

from inferd.bench.chaos_spec import ChaosSpec, planned_injections
from inferd.bench.chaos_stats import after_injection_mask, recovery_ms, window_stats
from inferd.bench.open_loop import sleep_until
from inferd.bench.report import ChaosReport

_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_WORKERS_PATH = "/admin/workers"


@dataclass
class Injection:
    """One signal sent; detect_s and replace_s stay None until measured (or if never measured)."""

    n: int
    at_s: float
    """When the signal was sent, in seconds from the start of the measured window."""
    worker_id: str
    pid: int
    signal: str
    ready_before: int
    """Ready workers of the model listed just before the injection (the victim included)."""
    detect_s: float | None = None
    replace_s: float | None = None


@dataclass
class _Pending:
    injection: Injection
    sent_at: float
    deadline: float

    @property
    def done(self) -> bool:
        return self.injection.replace_s is not None


class ChaosAgent:
    """Runs the injection schedule and the recovery measurements for one load run."""

    def __init__(self, spec: ChaosSpec, model: str, now: Callable[[], float]) -> None:
        self.spec = spec
        self.model = model
        self._now = now
        self._signal = _SIGNALS[spec.mode]
        self._hostname = spec.hostname or socket.gethostname()
        self._rng = random.Random(spec.seed)  # nosec B311  # picks fault victims, not secrets
        self._url = spec.admin_url.rstrip("/") + _WORKERS_PATH
        self._headers = {"Authorization": f"Bearer {spec.admin_token}"} if spec.admin_token else {}
        self.injections: list[Injection] = []
        self.skipped: Counter[str] = Counter()
        self.admin_errors: Counter[str] = Counter()
        self.signalled: set[int] = set()
        self.stopped: list[int] = []
        """Pids this agent sent SIGSTOP, in order."""
        self.resumed: list[int] = []
        """Stopped pids that still existed at the end and were sent SIGCONT."""
        self._pending: list[_Pending] = []
        self._session: aiohttp.ClientSession | None = None
        self._scheduler: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._window_start = 0.0
        self._closed = False

    # --- lifecycle ---

    def start(self, window_start: float, window_end: float) -> None:
        """Schedule injections at window_start + first_s + k * interval_s while before window_end."""
        if self._scheduler is not None:
            raise RuntimeError("ChaosAgent.start called twice")
        self._window_start = window_start
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.spec.admin_timeout_s),
            headers=self._headers,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._scheduler = asyncio.ensure_future(self._schedule(window_start, window_end))

    async def finish(self) -> None:
        """The load is over: no more injections; wait (bounded) for pending measurements, then clean up."""
        await self._cancel(self._scheduler)
        if self._monitor is not None:
            bound = self.spec.measure_timeout_s + self.spec.admin_timeout_s + 1.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._monitor), bound)
        await self.close()

    async def close(self) -> None:
        """Stop at once: resume every stopped pid first, then cancel tasks and close the admin session.
        Idempotent; safe from `finally` after an error or cancellation."""
        if self._closed:
            return
        self._closed = True
        self.resume_stopped()
        await self._cancel(self._scheduler)
        await self._cancel(self._monitor)
        if self._session is not None:
            await self._session.close()

    def resume_stopped(self) -> list[int]:
        """SIGCONT every pid this agent stopped that still exists (never leaves a process stopped)."""
        for pid in self.stopped:
            if pid in self.resumed:
                continue
            try:
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                continue
            self.resumed.append(pid)
        return self.resumed

    @staticmethod
    async def _cancel(task: asyncio.Task[None] | None) -> None:
        if task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # --- injections ---

    async def _schedule(self, window_start: float, window_end: float) -> None:
        spec = self.spec
        for k in range(spec.max_injections):
            at = window_start + spec.first_s + k * spec.interval_s
            if at >= window_end:
                return
            await sleep_until(at, self._now)
            if self._now() > at + spec.interval_s:  # a whole interval late (stalled loop): don't burst
                self.skipped["late"] += 1
                continue
            await self._inject()

    async def _inject(self) -> None:
        workers = await self._fetch()
        if workers is None:
            self.skipped["admin_unavailable"] += 1
            return
        ready = [w for w in workers if w.get("model") == self.model and w.get("state") == "ready"]
        candidates = [w for w in ready if self._eligible(w)]
        if not candidates:
            self.skipped["no_local_ready_worker"] += 1
            return
        victim = self._rng.choice(sorted(candidates, key=lambda w: str(w.get("worker_id"))))
        pid = int(victim["pid"])
        try:
            os.kill(pid, self._signal)
        except ProcessLookupError:
            self.skipped["victim_gone"] += 1
            return
        except PermissionError:
            self.skipped["not_permitted"] += 1
            return
        sent_at = self._now()
        self.signalled.add(pid)
        if self._signal == signal.SIGSTOP:
            self.stopped.append(pid)
        injection = Injection(
            n=len(self.injections),
            at_s=sent_at - self._window_start,
            worker_id=str(victim.get("worker_id")),
            pid=pid,
            signal=self._signal.name,
            ready_before=len(ready),
        )
        self.injections.append(injection)
        self._pending.append(_Pending(injection, sent_at, sent_at + self.spec.measure_timeout_s))
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.ensure_future(self._measure())

    def _eligible(self, w: dict[str, Any]) -> bool:
        pid = w.get("pid")
        return (
            w.get("host") == self._hostname
            and isinstance(pid, int)
            and not isinstance(pid, bool)
            and pid > 1
            and pid != os.getpid()
            and pid not in self.signalled
        )

    # --- measurements ---

    async def _measure(self) -> None:
        """Poll every poll_s while any injection is being measured; each stops at its own deadline."""
        next_poll = self._now()
        while self._pending:
            workers = await self._fetch()
            t = self._now()
            if workers is not None:
                for p in self._pending:
                    self._update(p, workers, t)
            self._pending = [p for p in self._pending if not p.done and t < p.deadline]
            next_poll = max(next_poll + self.spec.poll_s, t)
            if self._pending:
                await sleep_until(next_poll, self._now)

    def _update(self, p: _Pending, workers: list[dict[str, Any]], t: float) -> None:
        inj = p.injection
        if inj.detect_s is None:
            victim_ready = any(
                w.get("worker_id") == inj.worker_id and w.get("pid") == inj.pid and w.get("state") == "ready"
                for w in workers
            )
            if victim_ready:
                return
            inj.detect_s = t - p.sent_at
        ready = sum(1 for w in workers if w.get("model") == self.model and w.get("state") == "ready")
        if ready >= inj.ready_before:
            inj.replace_s = t - p.sent_at

    async def _fetch(self) -> list[dict[str, Any]] | None:
        """The admin API's worker list, or None (counted in admin_errors by kind)."""
        assert self._session is not None
        try:
            async with self._session.get(self._url) as resp:
                if resp.status != 200:
                    self.admin_errors[f"http_{resp.status}"] += 1
                    return None
                data = await resp.json(content_type=None)
        except TimeoutError:
            self.admin_errors["timeout"] += 1
            return None
        except (aiohttp.ClientError, OSError):
            self.admin_errors["connection"] += 1
            return None
        except ValueError:
            self.admin_errors["bad_json"] += 1
            return None
        workers = data.get("workers") if isinstance(data, dict) else None
        if not isinstance(workers, list):
            self.admin_errors["bad_json"] += 1
            return None
        return [w for w in workers if isinstance(w, dict)]

    # --- report ---

    def report(self, rel_offsets: np.ndarray, results: np.ndarray, duration_s: float) -> ChaosReport:
        """The chaos section: injections, recovery times, and latency after injections vs steady.

        rel_offsets: intended send times of the measured window's requests, in seconds from its start.
        results: per request, its latency in seconds when ok, -1 when sent but not ok, NaN when unsent.
        """
        at = [inj.at_s for inj in self.injections]
        after_mask = after_injection_mask(rel_offsets, at, self.spec.after_window_s)
        return ChaosReport(
            spec=self.spec.to_dict(),
            planned=planned_injections(self.spec, duration_s),
            injections=[asdict(inj) for inj in self.injections],
            skipped=dict(sorted(self.skipped.items())),
            admin_errors=dict(sorted(self.admin_errors.items())),
            detect_ms=recovery_ms([inj.detect_s for inj in self.injections]),
            replace_ms=recovery_ms([inj.replace_s for inj in self.injections]),
            after_injection=window_stats(results[after_mask]),
            steady=window_stats(results[~after_mask]),
            stopped_pids=list(self.stopped),
            resumed_pids=list(self.resumed),
        )
