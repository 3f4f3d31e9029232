"""Which external OpenAI-compatible engine (vLLM, SGLang, TGI...) takes the next request: least in-flight
among the healthy ones, with a hard per-upstream cap, ejection on failures and probing back.

A plain object with an injected clock and no I/O. The caller `acquire`s an upstream before sending (the
slot is taken at once, so the cap holds across concurrent callers), `release`s it with the request's
outcome, and reports each periodic `GET /v1/models` probe with `probed`. Health changes come back as
`HealthChange` values so the caller logs each one once (routing.health: the vocabulary worker routing
shares).

The rules:

* **Health** is ordered: READY > PROBING > EJECTED. Every upstream starts PROBING (nothing is known yet).
* **Choice.** Among upstreams with a free slot, the healthiest, then the least in flight; equal loads go
  round-robin (and are counted: `statistics().equal_loads`). A READY upstream takes at most
  `max_inflight` requests; a PROBING one takes one trial request at a time (never a half-open that
  admits everyone).
* **Refusals.** No routable upstream (all ejected, or all excluded): `WorkerUnavailable` (503), with a
  retry hint of when the first ejection ends. Routable ones but every one full: `Overloaded` (429).
* **Ejection.** `consecutive_failures` failures in a row (requests or probes) eject a READY upstream; one
  failure ejects a PROBING one. Ejection lasts `base_ejection_s`, doubling with each ejection, at most
  `max_ejection_s` (routing.backoff); an upstream that stayed READY for `max_ejection_s` starts again from
  the first.
* **Probing back.** When its ejection time is over the upstream is PROBING: its next probe or trial
  request decides. A success makes it READY; a failure ejects it again, for longer. Only request
  successes clear a READY upstream's run of failures (a probe that answers does not).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from inferd.clock import Clock
from inferd.errors import Overloaded, WorkerUnavailable
from inferd.routing.backoff import Backoff
from inferd.routing.health import Ejection, EjectionRecord, Health, HealthChange


class Outcome(enum.Enum):
    """How one request to an upstream went, as far as the upstream's health is concerned."""

    SUCCESS = "success"
    FAILURE = "failure"
    """The upstream failed (connection error, timeout, 5xx, broken stream): counts toward ejection."""
    IGNORABLE = "ignorable"
    """Says nothing about the upstream: the client left, the request was bad (4xx), or it was full (429)."""


RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Upstream answers worth one more try elsewhere, when nothing was streamed to the client yet."""


def classify_status(status: int) -> Outcome:
    """The one classifier of upstream HTTP answers, for health, retries and metrics."""
    if status < 400:
        return Outcome.SUCCESS
    if status >= 500:
        return Outcome.FAILURE
    return Outcome.IGNORABLE


@dataclass(frozen=True, slots=True)
class UpstreamStatus:
    """One upstream's record, for metrics, /debug and tests."""

    ejection: EjectionRecord
    inflight: int
    successes: int
    failures: int
    ignorable: int

    @property
    def upstream(self) -> str:
        return self.ejection.target

    @property
    def health(self) -> Health:
        return self.ejection.health


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    upstreams: tuple[UpstreamStatus, ...]
    choices: int
    equal_loads: int
    """Choices where the least-loaded upstream was tied with another of the same health."""
    refused_full: int
    refused_unavailable: int
    ejections: int


@dataclass(slots=True)
class _Record:
    ejection: Ejection
    inflight: int = 0
    outcomes: dict[Outcome, int] = field(default_factory=lambda: dict.fromkeys(Outcome, 0))


class UpstreamPool:
    def __init__(
        self,
        upstreams: Sequence[str],
        clock: Clock,
        *,
        name: str = "upstream pool",
        max_inflight: int = 64,
        consecutive_failures: int = 3,
        base_ejection_s: float = 5.0,
        max_ejection_s: float = 60.0,
        full_retry_after_s: float = 1.0,
    ) -> None:
        if not upstreams or len(set(upstreams)) != len(upstreams):
            raise ValueError(f"need at least one upstream and no duplicates, got {list(upstreams)}")
        if max_inflight < 1 or consecutive_failures < 1:
            raise ValueError(
                f"need max_inflight >= 1 and consecutive_failures >= 1, got {max_inflight}, "
                f"{consecutive_failures}"
            )
        if not 0 < base_ejection_s <= max_ejection_s:
            raise ValueError(
                f"need 0 < base_ejection_s <= max_ejection_s, got {base_ejection_s}, {max_ejection_s}"
            )
        self.clock = clock
        self.name = name
        """Who the pool serves (a model name), for error messages."""
        self.max_inflight = max_inflight
        self.consecutive_failures = consecutive_failures
        self.backoff = Backoff(base_ejection_s, max_ejection_s)
        """How long each ejection lasts: base_ejection_s, doubling with each one, up to max_ejection_s."""
        self.full_retry_after_s = full_retry_after_s
        self._records = {
            u: _Record(Ejection("upstream", u, self.backoff, Health.PROBING, reason="not probed yet"))
            for u in upstreams
        }
        self._cursor = 0
        self._choices = self._equal = self._full = self._unavailable = self._ejections = 0

    @property
    def upstreams(self) -> list[str]:
        return list(self._records)

    # ---- choosing --------------------------------------------------------------------------------------
    def acquire(self, exclude: Collection[str] = ()) -> str:
        """Take a slot on the best upstream not in `exclude`. Raises WorkerUnavailable or Overloaded."""
        routable = [(u, r) for u, r in self._records.items() if u not in exclude and self._routable(r)]
        if not routable:
            self._unavailable += 1
            raise WorkerUnavailable(self._unavailable_message(exclude), self._retry_after_s())
        free = [(u, r) for u, r in routable if r.inflight < self._cap(r)]
        if not free:
            self._full += 1
            raise Overloaded(
                f"{self.name}: every routable upstream is at its limit of {self.max_inflight} requests in flight "
                f"({', '.join(u for u, _ in routable)})",
                self.full_retry_after_s,
                reason="upstreams_full",
            )
        best = min((-r.ejection.health, r.inflight) for _, r in free)
        tied = [u for u, r in free if (-r.ejection.health, r.inflight) == best]
        self._equal += len(tied) > 1
        upstream = tied[self._cursor % len(tied)]
        self._cursor += 1
        self._choices += 1
        self._records[upstream].inflight += 1
        return upstream

    def release(self, upstream: str, outcome: Outcome) -> HealthChange | None:
        """The request sent to `upstream` by `acquire` is over, with this outcome."""
        rec = self._records[upstream]
        if rec.inflight < 1:
            raise ValueError(f"release of {upstream} without a matching acquire")
        rec.inflight -= 1
        rec.outcomes[outcome] += 1
        return self._judge(rec, outcome, f"a request {outcome.value}")

    def probed(self, upstream: str, ok: bool, detail: str = "") -> HealthChange | None:
        """The periodic `GET /v1/models` of `upstream` answered (ok) or failed (`detail` says how). A probe
        that answers makes a PROBING upstream READY, but does not clear a READY one's run of request
        failures: an engine can list its models and still fail every completion."""
        rec = self._records[upstream]
        if ok and self.health(upstream) is Health.READY:
            return None
        if ok:
            return self._judge(rec, Outcome.SUCCESS, "a probe answered")
        return self._judge(rec, Outcome.FAILURE, f"a probe failed{': ' + detail if detail else ''}")

    def can_take(self, exclude: Collection[str] = ()) -> bool:
        """Whether `acquire(exclude)` would find a free slot (a retry checks before spending its budget)."""
        return any(
            u not in exclude and self._routable(r) and r.inflight < self._cap(r)
            for u, r in self._records.items()
        )

    def health(self, upstream: str) -> Health:
        """READY, PROBING or EJECTED."""
        return self._records[upstream].ejection.refresh(self.clock.now())

    # ---- snapshots ---------------------------------------------------------------------------------------
    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            tuple(self._status(r) for r in self._records.values()),
            self._choices,
            self._equal,
            self._full,
            self._unavailable,
            self._ejections,
        )

    # ---- rules -------------------------------------------------------------------------------------------
    def _routable(self, rec: _Record) -> bool:
        return rec.ejection.refresh(self.clock.now()) in Health.ROUTABLE

    def _cap(self, rec: _Record) -> int:
        return self.max_inflight if rec.ejection.health is Health.READY else 1

    def _judge(self, rec: _Record, outcome: Outcome, event: str) -> HealthChange | None:
        now = self.clock.now()
        ejection = rec.ejection
        health = ejection.refresh(now)
        if outcome is Outcome.IGNORABLE or health is Health.EJECTED:
            return None  # an ejected upstream's late answers were sent before it was ejected: no proof
        if outcome is Outcome.SUCCESS:
            ejection.failures = 0
            return None if health is Health.READY else ejection.restore(now, event)
        ejection.failures += 1
        if health is Health.PROBING:
            return self._eject(ejection, now, f"{event} (while probing)")
        if ejection.failures >= self.consecutive_failures:
            return self._eject(ejection, now, f"{ejection.failures} failures in a row, the last: {event}")
        return None

    def _eject(self, ejection: Ejection, now: float, reason: str) -> HealthChange:
        self._ejections += 1
        return ejection.eject(now, reason)

    def _retry_after_s(self) -> float:
        now = self.clock.now()
        ends = [
            r.ejection.ejected_until - now
            for r in self._records.values()
            if r.ejection.health is Health.EJECTED
        ]
        return max(1.0, min(ends, default=1.0))

    def _unavailable_message(self, exclude: Collection[str]) -> str:
        now = self.clock.now()
        parts = []
        for u, r in self._records.items():
            if u in exclude:
                parts.append(f"{u} already tried")
            else:
                parts.append(
                    f"{u} ejected for {r.ejection.ejected_until - now:.1f}s more ({r.ejection.reason})"
                )
        return f"{self.name}: no healthy upstream: " + "; ".join(parts)

    def _status(self, rec: _Record) -> UpstreamStatus:
        counts = rec.outcomes
        return UpstreamStatus(
            rec.ejection.snapshot(self.clock.now()),
            rec.inflight,
            counts[Outcome.SUCCESS],
            counts[Outcome.FAILURE],
            counts[Outcome.IGNORABLE],
        )
