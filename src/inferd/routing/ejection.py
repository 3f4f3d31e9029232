"""Outlier ejection, Envoy style: a worker far slower than the rest of its fleet, or failing batch after batch,
takes no new work for a while, then one probe batch decides whether it comes back.

A plain object with an injected clock and no I/O. The caller tells it which workers exist (`add`, `remove`),
how each batch went (`observe`, `failure`), and asks `state(worker_id)` before routing. Changes it decides
come back as `EjectionChange` values, so the caller can log each one once.

The rules:

* **Slow.** Once a worker has `min_samples` batches in the last `window_s`, and their median latency is over
  `latency_ratio` x the median of the other in-service workers' medians (and at least `min_latency_s`, below
  which differences are noise), it is ejected.
* **Failing.** `consecutive_failures` whole-batch failures in a row (no success between) eject it too.
* **How long.** `base_ejection_s x times_ejected`, at most `max_ejection_s`. A worker that stayed in service
  for `max_ejection_s` after its last return starts again from one.
* **Probe.** When its time is up the worker is PROBING: the caller sends it one batch. A fast answer brings it
  back (IN) with a fresh history; a slow one or a failure ejects it again, for longer.
* **How many.** Ejected and probing workers together never exceed `max_ejected()`:
  `floor(max_ejection_share x workers)`, but at least one out of a fleet of two or more (else the rule would
  never act on small fleets, where one slow worker hurts most), and never the last in-service worker
  (so a fleet of one never ejects). When the fleet shrinks below what the share allows, the workers whose
  ejection ends soonest come back at once.
"""

from __future__ import annotations

import enum
import math
import statistics as stats
from collections import deque
from dataclasses import dataclass

from inferd.clock import Clock


class EjectionState(enum.Enum):
    IN = "in"
    """In service."""
    EJECTED = "ejected"
    """Takes no new work until its ejection time is over."""
    PROBING = "probing"
    """Ejection time over: its next batch decides whether it comes back."""

    OUT: frozenset[EjectionState]


EjectionState.OUT = frozenset({EjectionState.EJECTED, EjectionState.PROBING})


@dataclass(frozen=True, slots=True)
class EjectionChange:
    """A decision the caller should act on (and log once)."""

    worker_id: str
    state: EjectionState
    reason: str
    ejected_for_s: float = 0.0

    def __str__(self) -> str:
        if self.state is EjectionState.IN:
            return f"worker {self.worker_id} back in service: {self.reason}"
        return f"worker {self.worker_id} ejected for {self.ejected_for_s:.1f}s: {self.reason}"


@dataclass(frozen=True, slots=True)
class WorkerEjection:
    """One worker's ejection record, for the admin API and tests."""

    state: EjectionState
    times_ejected: int
    ejected_until: float | None
    consecutive_failures: int
    reason: str


@dataclass(frozen=True, slots=True)
class EjectionStatistics:
    workers: int
    ejected: int
    probing: int
    max_ejected: int
    ejections_total: int
    returned_total: int
    """Workers brought back: their probe batch was fast, or the fleet shrank."""
    refused_by_share_total: int
    """Ejections the rules asked for that the share cap refused."""


@dataclass(slots=True)
class _Record:
    samples: deque[tuple[float, float]]
    state: EjectionState = EjectionState.IN
    times_ejected: int = 0
    ejected_until: float = 0.0
    returned_at: float | None = None
    failures: int = 0
    reason: str = ""


class OutlierEjector:
    def __init__(
        self,
        clock: Clock,
        *,
        latency_ratio: float = 3.0,
        consecutive_failures: int = 5,
        base_ejection_s: float = 5.0,
        max_ejection_s: float = 60.0,
        max_ejection_share: float = 0.3,
        window_s: float = 10.0,
        min_samples: int = 3,
        max_samples: int = 32,
        min_latency_s: float = 0.001,
    ) -> None:
        if latency_ratio <= 1.0:
            raise ValueError(f"latency_ratio must be > 1, got {latency_ratio}")
        if consecutive_failures < 1 or min_samples < 1 or max_samples < min_samples:
            raise ValueError(
                f"need consecutive_failures >= 1 and 1 <= min_samples <= max_samples, got "
                f"{consecutive_failures}, {min_samples}, {max_samples}"
            )
        if not 0 < base_ejection_s <= max_ejection_s:
            raise ValueError(
                f"need 0 < base_ejection_s <= max_ejection_s, got {base_ejection_s}, {max_ejection_s}"
            )
        if not 0.0 <= max_ejection_share <= 1.0:
            raise ValueError(f"max_ejection_share must be within [0, 1], got {max_ejection_share}")
        if window_s <= 0 or min_latency_s < 0:
            raise ValueError(f"need window_s > 0 and min_latency_s >= 0, got {window_s}, {min_latency_s}")
        self.clock = clock
        self.latency_ratio = latency_ratio
        self.consecutive_failures = consecutive_failures
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max_ejection_s
        self.max_ejection_share = max_ejection_share
        self.window_s = window_s
        self.min_samples = min_samples
        self.max_samples = max_samples
        self.min_latency_s = min_latency_s
        self._workers: dict[str, _Record] = {}
        self._departed: dict[str, tuple[float, _Record]] = {}
        """Records of workers that left, kept for max_ejection_s: a worker that reconnects under the same
        id (a remote worker after its connection broke) keeps its ejection instead of starting clean."""
        self._ejections = self._returned = self._refused = 0

    # ---- the fleet -----------------------------------------------------------------------------------
    def add(self, worker_id: str) -> None:
        self._forget_departed()
        departed = self._departed.pop(worker_id, None)
        if departed is not None and worker_id not in self._workers:
            rec = self._workers[worker_id] = departed[1]
            out = sum(1 for r in self._workers.values() if r.state in EjectionState.OUT)
            if rec.state in EjectionState.OUT and out > self.max_ejected():
                self._return(worker_id, rec, "back while the ejection share is taken by others")
        self._workers.setdefault(worker_id, _Record(deque(maxlen=self.max_samples)))

    def remove(self, worker_id: str) -> list[EjectionChange]:
        """The worker left (lost or draining). If the smaller fleet allows fewer ejections, the workers
        whose ejection ends soonest come back now."""
        rec = self._workers.pop(worker_id, None)
        if rec is not None and rec.times_ejected:
            self._forget_departed()
            self._departed[worker_id] = (self.clock.now(), rec)
        changes = []
        out = [r for r in self._workers.items() if r[1].state in EjectionState.OUT]
        out.sort(key=lambda r: r[1].ejected_until)
        for wid, rec in out[: max(0, len(out) - self.max_ejected())]:
            changes.append(self._return(wid, rec, "the fleet shrank below what the ejection share allows"))
        return changes

    def max_ejected(self) -> int:
        n = len(self._workers)
        if n < 2:
            return 0
        return min(n - 1, max(1, math.floor(self.max_ejection_share * n)))

    def state(self, worker_id: str) -> EjectionState:
        rec = self._workers.get(worker_id)
        return EjectionState.IN if rec is None else self._refresh(rec)

    # ---- what happened -------------------------------------------------------------------------------
    def observe(self, worker_id: str, latency_s: float) -> EjectionChange | None:
        """A batch of this worker succeeded after `latency_s`."""
        rec = self._workers.get(worker_id)
        if rec is None:
            return None
        rec.failures = 0
        state = self._refresh(rec)
        if state is EjectionState.EJECTED:  # a batch sent before the ejection: it proves nothing
            return None
        now = self.clock.now()
        reference = self._reference(worker_id)
        if state is EjectionState.PROBING:
            if reference is not None and self._slow(latency_s, reference):
                return self._eject(
                    worker_id, rec, f"probe batch took {_ms(latency_s)}, fleet {_ms(reference)}"
                )
            change = self._return(worker_id, rec, f"probe batch took {_ms(latency_s)}")
            rec.samples.append((now, latency_s))
            return change
        rec.samples.append((now, latency_s))
        own = self._median(rec)
        if own is None or reference is None or not self._slow(own, reference):
            return None
        return self._eject_if_allowed(
            worker_id,
            rec,
            f"median batch latency {_ms(own)} over {self.latency_ratio:g} x the fleet's {_ms(reference)}",
        )

    def is_slow(self, worker_id: str, running_s: float) -> bool:
        """Whether `running_s` is slow against the other in-service workers' median batch latency."""
        reference = self._reference(worker_id)
        return reference is not None and self._slow(running_s, reference)

    def overdue(self, worker_id: str, running_s: float) -> EjectionChange | None:
        """A batch of this worker has been running `running_s` and is not done: if that is already slow
        against the fleet, eject now rather than after the batch ends (it may take many times longer)."""
        rec = self._workers.get(worker_id)
        if rec is None:
            return None
        state = self._refresh(rec)
        reference = self._reference(worker_id)
        if state is EjectionState.EJECTED or reference is None or not self._slow(running_s, reference):
            return None
        reason = f"a batch still running after {_ms(running_s)}, fleet {_ms(reference)}"
        if state is EjectionState.PROBING:
            return self._eject(worker_id, rec, reason)
        return self._eject_if_allowed(worker_id, rec, reason)

    def _forget_departed(self) -> None:
        cutoff = self.clock.now() - self.max_ejection_s
        for wid in [w for w, (at, _) in self._departed.items() if at < cutoff]:
            del self._departed[wid]

    def failure(self, worker_id: str) -> EjectionChange | None:
        """A whole batch of this worker failed."""
        rec = self._workers.get(worker_id)
        if rec is None:
            return None
        rec.failures += 1
        state = self._refresh(rec)
        if state is EjectionState.PROBING:
            return self._eject(worker_id, rec, "its probe batch failed")
        if state is EjectionState.IN and rec.failures >= self.consecutive_failures:
            return self._eject_if_allowed(worker_id, rec, f"{rec.failures} batches failed in a row")
        return None

    # ---- snapshots -------------------------------------------------------------------------------------
    def status(self, worker_id: str) -> WorkerEjection:
        rec = self._workers.get(worker_id)
        if rec is None:
            return WorkerEjection(EjectionState.IN, 0, None, 0, "")
        state = self._refresh(rec)
        until = rec.ejected_until if state is EjectionState.EJECTED else None
        return WorkerEjection(state, rec.times_ejected, until, rec.failures, rec.reason)

    def statistics(self) -> EjectionStatistics:
        states = [self._refresh(r) for r in self._workers.values()]
        return EjectionStatistics(
            len(states),
            states.count(EjectionState.EJECTED),
            states.count(EjectionState.PROBING),
            self.max_ejected(),
            self._ejections,
            self._returned,
            self._refused,
        )

    # ---- rules ---------------------------------------------------------------------------------------
    def _refresh(self, rec: _Record) -> EjectionState:
        if rec.state is EjectionState.EJECTED and self.clock.now() >= rec.ejected_until:
            rec.state = EjectionState.PROBING
        return rec.state

    def _slow(self, latency_s: float, reference_s: float) -> bool:
        return latency_s >= self.min_latency_s and latency_s > self.latency_ratio * reference_s

    def _median(self, rec: _Record) -> float | None:
        cutoff = self.clock.now() - self.window_s
        while rec.samples and rec.samples[0][0] < cutoff:
            rec.samples.popleft()
        if len(rec.samples) < self.min_samples:
            return None
        return stats.median(latency for _, latency in rec.samples)

    def _reference(self, worker_id: str) -> float | None:
        """The median of the other in-service workers' median latencies (those with enough samples)."""
        medians = [
            m
            for wid, rec in self._workers.items()
            if wid != worker_id and self._refresh(rec) is EjectionState.IN
            for m in [self._median(rec)]
            if m is not None
        ]
        return stats.median(medians) if medians else None

    def _eject_if_allowed(self, worker_id: str, rec: _Record, reason: str) -> EjectionChange | None:
        out = sum(1 for r in self._workers.values() if r.state in EjectionState.OUT)
        if out + 1 > self.max_ejected():
            self._refused += 1
            return None
        return self._eject(worker_id, rec, reason)

    def _eject(self, worker_id: str, rec: _Record, reason: str) -> EjectionChange:
        now = self.clock.now()
        if rec.returned_at is not None and now - rec.returned_at >= self.max_ejection_s:
            rec.times_ejected = 0  # in service long enough: the earlier ejections are forgiven
        rec.times_ejected += 1
        rec.state = EjectionState.EJECTED
        duration_s = min(self.max_ejection_s, self.base_ejection_s * rec.times_ejected)
        rec.ejected_until = now + duration_s
        rec.samples.clear()
        rec.failures = 0
        rec.reason = reason
        self._ejections += 1
        return EjectionChange(worker_id, EjectionState.EJECTED, reason, duration_s)

    def _return(self, worker_id: str, rec: _Record, reason: str) -> EjectionChange:
        rec.state = EjectionState.IN
        rec.returned_at = self.clock.now()
        rec.samples.clear()
        rec.reason = ""
        self._returned += 1
        return EjectionChange(worker_id, EjectionState.IN, reason)


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms"
