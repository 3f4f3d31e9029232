"""The health vocabulary every routing policy shares: the worker balancer, outlier ejection, the LLM
router and the upstream pool.

* `Health`: one ordered value for any target (a worker, an upstream engine). Higher is healthier; only
  `Health.ROUTABLE` values take new work.
* `HealthChange`: a decision a policy returns for its caller to act on and log once.
* `EjectionRecord`: one target's ejection history, as a frozen snapshot for the admin API, metrics and tests.
* `Ejection`: the mutable history behind that record, with the rules every ejecting policy applies to it.
  An ejection lasts `backoff.delay_s(times_ejected - 1)` (capped exponential); when it is over the target
  is PROBING, and its next outcome decides; a target that stayed in service for `backoff.max_s` since it
  last came back is forgiven its earlier ejections. When to eject is each policy's own rule.

Plain values and objects: no clock of their own (callers pass `now`), no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from inferd.routing.backoff import Backoff


class Health(enum.IntEnum):
    """Ordered by value: higher is healthier. EJECTED, PROBING and READY keep the values the
    `inferd_upstream_health` gauge exports (0, 1, 2)."""

    DEAD = -2
    """Gone."""
    DRAINING = -1
    """Finishing what it holds; takes nothing new."""
    EJECTED = 0
    """Takes no new work until its ejection time is over."""
    PROBING = 1
    """Unknown yet, or back from an ejection: takes one trial at a time and loses every tie-break against
    READY; its next outcome decides."""
    READY = 2

    ROUTABLE: frozenset[Health]
    OUT: frozenset[Health]
    """Out of full service because of an ejection (what an ejection share counts)."""


Health.ROUTABLE = frozenset({Health.READY, Health.PROBING})
Health.OUT = frozenset({Health.EJECTED, Health.PROBING})


@dataclass(frozen=True, slots=True)
class HealthChange:
    """A decision the caller should act on (and log once)."""

    kind: str
    """What the target is: "worker", "upstream"."""
    target: str
    """Its id: a worker id, an upstream URL."""
    health: Health
    reason: str
    ejected_for_s: float = 0.0

    def __str__(self) -> str:
        if self.health is Health.EJECTED:
            return f"{self.kind} {self.target} ejected for {self.ejected_for_s:.1f}s: {self.reason}"
        return f"{self.kind} {self.target} is {self.health.name.lower()}: {self.reason}"


@dataclass(frozen=True, slots=True)
class EjectionRecord:
    """One target's ejection history at one instant."""

    target: str
    health: Health
    times_ejected: int
    ejected_until: float | None
    """When its ejection ends, while EJECTED."""
    consecutive_failures: int
    reason: str
    """Why it was last ejected (empty once back in service), or why it is not in service yet."""


@dataclass(slots=True)
class Ejection:
    """One target's ejection history, and the rules that move it."""

    kind: str
    target: str
    backoff: Backoff
    health: Health = Health.READY
    times_ejected: int = 0
    ejected_until: float = 0.0
    in_service_since: float | None = None
    """When it last came back (READY); None while out, or before it ever was."""
    failures: int = 0
    """Failures in a row, with no success between."""
    reason: str = ""

    def refresh(self, now: float) -> Health:
        """Its health now: an ejection whose time is over becomes PROBING."""
        if self.health is Health.EJECTED and now >= self.ejected_until:
            self.health = Health.PROBING
        return self.health

    def eject(self, now: float, reason: str) -> HealthChange:
        """Out for the next step of the backoff (from the first again once forgiven)."""
        if self.in_service_since is not None and now - self.in_service_since >= self.backoff.max_s:
            self.times_ejected = 0  # in service long enough: the earlier ejections are forgiven
        self.times_ejected += 1
        duration_s = self.backoff.delay_s(self.times_ejected - 1)
        self.health, self.ejected_until, self.in_service_since = Health.EJECTED, now + duration_s, None
        self.failures = 0
        self.reason = reason
        return HealthChange(self.kind, self.target, Health.EJECTED, reason, duration_s)

    def restore(self, now: float, reason: str) -> HealthChange:
        """Back in service (READY), with no failures counted."""
        self.health, self.in_service_since = Health.READY, now
        self.failures = 0
        self.reason = ""
        return HealthChange(self.kind, self.target, Health.READY, reason)

    def snapshot(self, now: float) -> EjectionRecord:
        health = self.refresh(now)
        until = self.ejected_until if health is Health.EJECTED else None
        return EjectionRecord(self.target, health, self.times_ejected, until, self.failures, self.reason)
