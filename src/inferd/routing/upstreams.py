"""Which external OpenAI-compatible engine (vLLM, SGLang, TGI...) takes the next request: least in-flight
among the healthy ones, with a hard per-upstream cap, ejection on failures and probing back.

A plain object with an injected clock and no I/O. The caller `acquire`s an upstream before sending (the
slot is taken at once, so the cap holds across concurrent callers), `release`s it with the request's
outcome, and reports each periodic `GET /v1/models` probe with `probed`. Health changes come back as
`HealthChange` values so the caller logs each one once.

The rules:

* **Health** is ordered: UP > PROBING > EJECTED. Every upstream starts PROBING (nothing is known yet).
* **Choice.** Among upstreams with a free slot, the healthiest, then the least in flight; equal loads go
  round-robin (and are counted: `statistics().equal_loads`). An UP upstream takes at most
  `max_inflight` requests; a PROBING one takes one trial request at a time (never a half-open that
  admits everyone).
* **Refusals.** No routable upstream (all ejected, or all excluded): `WorkerUnavailable` (503), with a
  retry hint of when the first ejection ends. Routable ones but every one full: `Overloaded` (429).
* **Ejection.** `consecutive_failures` failures in a row (requests or probes) eject an UP upstream; one
  failure ejects a PROBING one. Ejection lasts `base_ejection_s x times_ejected`, at most
  `max_ejection_s`; an upstream that stayed UP for `max_ejection_s` starts again from one.
* **Probing back.** When its ejection time is over the upstream is PROBING: its next probe or trial
  request decides. A success brings it UP; a failure ejects it again, for longer. Only request
  successes clear an UP upstream's run of failures (a probe that answers does not).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from inferd.clock import Clock
from inferd.errors import Overloaded, WorkerUnavailable


class UpstreamHealth(enum.IntEnum):
    """Ordered by value: higher is healthier."""

    EJECTED = 0
    """Takes no request until its ejection time is over."""
    PROBING = 1
    """Unknown or just back from ejection: one trial request at a time; the next outcome decides."""
    UP = 2

    ROUTABLE: frozenset[UpstreamHealth]


UpstreamHealth.ROUTABLE = frozenset({UpstreamHealth.PROBING, UpstreamHealth.UP})


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
class HealthChange:
    """A state change the caller should log once."""

    upstream: str
    health: UpstreamHealth
    reason: str
    ejected_for_s: float = 0.0

    def __str__(self) -> str:
        if self.health is UpstreamHealth.EJECTED:
            return f"upstream {self.upstream} ejected for {self.ejected_for_s:.1f}s: {self.reason}"
        return f"upstream {self.upstream} is {self.health.name.lower()}: {self.reason}"


@dataclass(frozen=True, slots=True)
class UpstreamStatus:
    """One upstream's record, for metrics, /debug and tests."""

    upstream: str
    health: UpstreamHealth
    inflight: int
    consecutive_failures: int
    times_ejected: int
    ejected_until: float | None
    reason: str
    successes: int
    failures: int
    ignorable: int


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
    health: UpstreamHealth = UpstreamHealth.PROBING
    inflight: int = 0
    failures_in_row: int = 0
    times_ejected: int = 0
    ejected_until: float = 0.0
    up_since: float | None = None
    reason: str = "not probed yet"
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
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max_ejection_s
        self.full_retry_after_s = full_retry_after_s
        self._records = {u: _Record() for u in upstreams}
        self._cursor = 0
        self._choices = self._equal = self._full = self._unavailable = self._ejections = 0

    @property
    def upstreams(self) -> list[str]:
        return list(self._records)

    # ---- choosing --------------------------------------------------------------------------------------
    def acquire(self, exclude: Collection[str] = ()) -> str:
        """Take a slot on the best upstream not in `exclude`. Raises WorkerUnavailable or Overloaded."""
        routable = [
            (u, r)
            for u, r in self._records.items()
            if u not in exclude and self._refresh(r) in UpstreamHealth.ROUTABLE
        ]
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
        best = min((-r.health, r.inflight) for _, r in free)
        tied = [u for u, r in free if (-r.health, r.inflight) == best]
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
        return self._judge(upstream, rec, outcome, f"a request {outcome.value}")

    def probed(self, upstream: str, ok: bool, detail: str = "") -> HealthChange | None:
        """The periodic `GET /v1/models` of `upstream` answered (ok) or failed (`detail` says how). A probe
        that answers brings a PROBING upstream up, but does not clear an UP one's run of request failures:
        an engine can list its models and still fail every completion."""
        rec = self._records[upstream]
        if ok and self._refresh(rec) is UpstreamHealth.UP:
            return None
        if ok:
            return self._judge(upstream, rec, Outcome.SUCCESS, "a probe answered")
        return self._judge(upstream, rec, Outcome.FAILURE, f"a probe failed{': ' + detail if detail else ''}")

    def can_take(self, exclude: Collection[str] = ()) -> bool:
        """Whether `acquire(exclude)` would find a free slot (a retry checks before spending its budget)."""
        return any(
            u not in exclude and self._refresh(r) in UpstreamHealth.ROUTABLE and r.inflight < self._cap(r)
            for u, r in self._records.items()
        )

    def health(self, upstream: str) -> UpstreamHealth:
        return self._refresh(self._records[upstream])

    # ---- snapshots ---------------------------------------------------------------------------------------
    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            tuple(self._status(u, r) for u, r in self._records.items()),
            self._choices,
            self._equal,
            self._full,
            self._unavailable,
            self._ejections,
        )

    # ---- rules -------------------------------------------------------------------------------------------
    def _cap(self, rec: _Record) -> int:
        return self.max_inflight if rec.health is UpstreamHealth.UP else 1

    def _refresh(self, rec: _Record) -> UpstreamHealth:
        if rec.health is UpstreamHealth.EJECTED and self.clock.now() >= rec.ejected_until:
            rec.health = UpstreamHealth.PROBING
        return rec.health

    def _judge(self, upstream: str, rec: _Record, outcome: Outcome, event: str) -> HealthChange | None:
        health = self._refresh(rec)
        if outcome is Outcome.IGNORABLE or health is UpstreamHealth.EJECTED:
            return (
                None  # an ejected upstream's late answers were sent before the ejection: they prove nothing
            )
        if outcome is Outcome.SUCCESS:
            rec.failures_in_row = 0
            if health is UpstreamHealth.UP:
                return None
            rec.health, rec.up_since, rec.reason = UpstreamHealth.UP, self.clock.now(), ""
            return HealthChange(upstream, UpstreamHealth.UP, event)
        rec.failures_in_row += 1
        if health is UpstreamHealth.PROBING:
            return self._eject(upstream, rec, f"{event} (while probing)")
        if rec.failures_in_row >= self.consecutive_failures:
            return self._eject(upstream, rec, f"{rec.failures_in_row} failures in a row, the last: {event}")
        return None

    def _eject(self, upstream: str, rec: _Record, reason: str) -> HealthChange:
        now = self.clock.now()
        if rec.up_since is not None and now - rec.up_since >= self.max_ejection_s:
            rec.times_ejected = 0  # up long enough: earlier ejections are forgiven
        rec.times_ejected += 1
        duration_s = min(self.max_ejection_s, self.base_ejection_s * rec.times_ejected)
        rec.health, rec.ejected_until, rec.up_since = UpstreamHealth.EJECTED, now + duration_s, None
        rec.failures_in_row = 0
        rec.reason = reason
        self._ejections += 1
        return HealthChange(upstream, UpstreamHealth.EJECTED, reason, duration_s)

    def _retry_after_s(self) -> float:
        now = self.clock.now()
        ends = [r.ejected_until - now for r in self._records.values() if r.health is UpstreamHealth.EJECTED]
        return max(1.0, min(ends, default=1.0))

    def _unavailable_message(self, exclude: Collection[str]) -> str:
        now = self.clock.now()
        parts = []
        for u, r in self._records.items():
            if u in exclude:
                parts.append(f"{u} already tried")
            else:
                parts.append(f"{u} ejected for {r.ejected_until - now:.1f}s more ({r.reason})")
        return f"{self.name}: no healthy upstream: " + "; ".join(parts)

    def _status(self, upstream: str, rec: _Record) -> UpstreamStatus:
        health = self._refresh(rec)
        return UpstreamStatus(
            upstream,
            health,
            rec.inflight,
            rec.failures_in_row,
            rec.times_ejected,
            rec.ejected_until if health is UpstreamHealth.EJECTED else None,
            rec.reason,
            rec.outcomes[Outcome.SUCCESS],
            rec.outcomes[Outcome.FAILURE],
            rec.outcomes[Outcome.IGNORABLE],
        )
