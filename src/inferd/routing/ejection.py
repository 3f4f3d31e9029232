"""Outlier ejection, Envoy style: a worker far slower than the rest of its fleet, or failing batch after batch,
takes no new work for a while, then one probe batch decides whether it comes back.

A plain object with an injected clock and no I/O. The caller tells it which workers exist (`add`, `remove`),
how each batch went (`observe`, `failure`), and asks `health(worker_id)` before routing: READY (in service),
EJECTED or PROBING (routing.health's one vocabulary). Changes it decides come back as `HealthChange` values,
so the caller can log each one once.

The rules:

* **Slow.** Once a worker has `min_samples` batches in the last `window_s`, and their median latency is over
  `latency_ratio` x the median of the other in-service workers' medians (and at least `min_latency_s`, below
  which differences are noise), it is ejected.
* **Failing.** `consecutive_failures` whole-batch failures in a row (no success between) eject it too.
* **How long.** `base_ejection_s`, doubling with each ejection, at most `max_ejection_s` (routing.backoff).
  A worker that stayed in service for `max_ejection_s` after its last return starts again from the first.
* **Probe.** When its time is up the worker is PROBING: the caller sends it one batch. A fast answer brings it
  back (READY) with a fresh history; a slow one or a failure ejects it again, for longer.
* **How many.** Ejected and probing workers together never exceed `max_ejected()`:
  `floor(max_ejection_share x workers)`, but at least one out of a fleet of two or more (else the rule would
  never act on small fleets, where one slow worker hurts most), and never the last in-service worker
  (so a fleet of one never ejects). When the fleet shrinks below what the share allows, the workers whose
  ejection ends soonest come back at once.
"""

from __future__ import annotations

import math
import statistics as stats
from collections import deque
from dataclasses import dataclass

from inferd.clock import Clock
from inferd.routing.backoff import Backoff
from inferd.routing.health import Ejection, EjectionRecord, Health, HealthChange


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
    ejection: Ejection
    samples: deque[tuple[float, float]]


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
        self.backoff = Backoff(base_ejection_s, max_ejection_s)
        """How long each ejection lasts: base_ejection_s, doubling with each one, up to max_ejection_s."""
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
            if rec.ejection.health in Health.OUT and self._out() > self.max_ejected():
                self._return(rec, "back while the ejection share is taken by others")
        if worker_id not in self._workers:
            ejection = Ejection("worker", worker_id, self.backoff)
            self._workers[worker_id] = _Record(ejection, deque(maxlen=self.max_samples))

    def remove(self, worker_id: str) -> list[HealthChange]:
        """The worker left (lost or draining). If the smaller fleet allows fewer ejections, the workers
        whose ejection ends soonest come back now."""
        rec = self._workers.pop(worker_id, None)
        if rec is not None and rec.ejection.times_ejected:
            self._forget_departed()
            self._departed[worker_id] = (self.clock.now(), rec)
        out = [r for r in self._workers.values() if r.ejection.health in Health.OUT]
        out.sort(key=lambda r: r.ejection.ejected_until)
        return [
            self._return(r, "the fleet shrank below what the ejection share allows")
            for r in out[: max(0, len(out) - self.max_ejected())]
        ]

    def max_ejected(self) -> int:
        n = len(self._workers)
        if n < 2:
            return 0
        return min(n - 1, max(1, math.floor(self.max_ejection_share * n)))

    def health(self, worker_id: str) -> Health:
        """READY (in service), EJECTED or PROBING; READY for a worker it does not know."""
        rec = self._workers.get(worker_id)
        return Health.READY if rec is None else rec.ejection.refresh(self.clock.now())

    # ---- what happened -------------------------------------------------------------------------------
    def observe(self, worker_id: str, latency_s: float) -> HealthChange | None:
        """A batch of this worker succeeded after `latency_s`."""
        rec = self._workers.get(worker_id)
        if rec is None:
            return None
        now = self.clock.now()
        rec.ejection.failures = 0
        health = rec.ejection.refresh(now)
        if health is Health.EJECTED:  # a batch sent before the ejection: it proves nothing
            return None
        reference = self._reference(worker_id)
        if health is Health.PROBING:
            if reference is not None and self._slow(latency_s, reference):
                return self._eject(rec, f"probe batch took {_ms(latency_s)}, fleet {_ms(reference)}")
            change = self._return(rec, f"probe batch took {_ms(latency_s)}")
            rec.samples.append((now, latency_s))
            return change
        rec.samples.append((now, latency_s))
        own = self._median(rec)
        if own is None or reference is None or not self._slow(own, reference):
            return None
        return self._eject_if_allowed(
            rec, f"median batch latency {_ms(own)} over {self.latency_ratio:g} x the fleet's {_ms(reference)}"
        )

    def is_slow(self, worker_id: str, running_s: float) -> bool:
        """Whether `running_s` is slow against the other in-service workers' median batch latency."""
        reference = self._reference(worker_id)
        return reference is not None and self._slow(running_s, reference)

    def overdue(self, worker_id: str, running_s: float) -> HealthChange | None:
        """A batch of this worker has been running `running_s` and is not done: if that is already slow
        against the fleet, eject now rather than after the batch ends (it may take many times longer)."""
        rec = self._workers.get(worker_id)
        if rec is None:
            return None
        health = rec.ejection.refresh(self.clock.now())
        reference = self._reference(worker_id)
        if health is Health.EJECTED or reference is None or not self._slow(running_s, reference):
            return None
        reason = f"a batch still running after {_ms(running_s)}, fleet {_ms(reference)}"
        if health is Health.PROBING:
            return self._eject(rec, reason)
        return self._eject_if_allowed(rec, reason)

    def failure(self, worker_id: str) -> HealthChange | None:
        """A whole batch of this worker failed."""
        rec = self._workers.get(worker_id)
        if rec is None:
            return None
        ejection = rec.ejection
        ejection.failures += 1
        health = ejection.refresh(self.clock.now())
        if health is Health.PROBING:
            return self._eject(rec, "its probe batch failed")
        if health is Health.READY and ejection.failures >= self.consecutive_failures:
            return self._eject_if_allowed(rec, f"{ejection.failures} batches failed in a row")
        return None

    # ---- snapshots -------------------------------------------------------------------------------------
    def status(self, worker_id: str) -> EjectionRecord:
        rec = self._workers.get(worker_id)
        if rec is None:
            return EjectionRecord(worker_id, Health.READY, 0, None, 0, "")
        return rec.ejection.snapshot(self.clock.now())

    def statistics(self) -> EjectionStatistics:
        now = self.clock.now()
        healths = [r.ejection.refresh(now) for r in self._workers.values()]
        return EjectionStatistics(
            len(healths),
            healths.count(Health.EJECTED),
            healths.count(Health.PROBING),
            self.max_ejected(),
            self._ejections,
            self._returned,
            self._refused,
        )

    # ---- rules ---------------------------------------------------------------------------------------
    def _forget_departed(self) -> None:
        cutoff = self.clock.now() - self.max_ejection_s
        for wid in [w for w, (at, _) in self._departed.items() if at < cutoff]:
            del self._departed[wid]

    def _out(self) -> int:
        return sum(1 for r in self._workers.values() if r.ejection.health in Health.OUT)

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
        now = self.clock.now()
        medians = [
            m
            for wid, rec in self._workers.items()
            if wid != worker_id and rec.ejection.refresh(now) is Health.READY
            for m in [self._median(rec)]
            if m is not None
        ]
        return stats.median(medians) if medians else None

    def _eject_if_allowed(self, rec: _Record, reason: str) -> HealthChange | None:
        if self._out() + 1 > self.max_ejected():
            self._refused += 1
            return None
        return self._eject(rec, reason)

    def _eject(self, rec: _Record, reason: str) -> HealthChange:
        rec.samples.clear()
        self._ejections += 1
        return rec.ejection.eject(self.clock.now(), reason)

    def _return(self, rec: _Record, reason: str) -> HealthChange:
        rec.samples.clear()
        self._returned += 1
        return rec.ejection.restore(self.clock.now(), reason)


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms"
