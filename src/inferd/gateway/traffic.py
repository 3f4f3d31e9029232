"""`TrafficSplit`: which version answers a request that names no version. A plain policy on an injected
clock and random source, no I/O; decisions (promote, roll back) are returned as values for the owner
(gateway/traffic_control.py) to carry out.

- **Canary.** A share `w` of unversioned requests go to the canary version, the rest to the default
  version; a draw from the injected RNG decides each. With `steps`, the weight moves to the next step
  every `step_interval_s` while the canary is healthy; when the last step is 1.0 and reached, the split
  returns `Promote` (the owner makes the canary the default version) and goes inert.
- **Rollback.** With `rollback`, each canary and baseline outcome feeds a `CanaryJudge`; on a breach the
  split returns `RolledBack`, the weight goes to 0 and stays 0 until the config is loaded again.
- **Sticky A/B.** The arm is chosen by sha256 over the model name and a sticky key (the tenant's name,
  or a header's value), so one key gets the same arm on every front end, every time. A request without
  a key is drawn at random.

Requests that name a version are never split: the owner consults the split only for those that do not.

With several front ends one split decides for all: the lease holder's (it judges every front end's
outcomes, `record`, and steps on its clock, `tick`); the others follow it. A split's `shared()` state
(step, rolled back or promoted, under the key of its config) goes to the other front ends through the
shared store, and `merge` moves a split forward to a peer's state, never back (gateway/canary_share.py).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from inferd.clock import Clock
from inferd.config.traffic import TrafficConfig
from inferd.gateway.canary_judge import Breach, CanaryJudge

JUDGE_INTERVAL_S = 1.0
"""How often, at most, the judge looks at its windows (each look is linear in the outcomes held)."""


@dataclass(frozen=True, slots=True)
class Promote:
    """The canary reached weight 1.0 on its last step: make it the default version."""

    model: str
    version: int


@dataclass(frozen=True, slots=True)
class RolledBack:
    """The canary breached its rollback bounds: its weight is now 0."""

    model: str
    version: int
    reason: str
    breach: Breach | None = None
    """The judge's figures; None when the rollback was decided by another front end (merged)."""


@dataclass(frozen=True, slots=True)
class WeightChanged:
    """The canary moved to its next step."""

    model: str
    version: int
    weight: float


Decision = Promote | RolledBack | WeightChanged


@dataclass(frozen=True, slots=True)
class SplitStatistics:
    model: str
    mode: str
    """"canary", "ab" or "none"."""
    weights: dict[int, float]
    """Version -> share of unversioned requests, as of now (the default version's included)."""
    canary_version: int | None
    step: int
    state: str
    """"active", "rolled_back", "promoted" (canary) or "active" (A/B)."""
    steps: tuple[float, ...] = ()
    """The canary's weights, step by step (`step` indexes them); () without a canary."""


@dataclass(frozen=True, slots=True)
class SplitState:
    """What one front end's canary split tells the others: how far it went, under which config."""

    key: str
    """The split's config (canary, rollback, A/B) digest: a state applies only to the same config."""
    step: int
    state: str
    reason: str = ""
    """Why it was rolled back (the judge's breach), else ""."""

    @property
    def rank(self) -> tuple[int, int]:
        """Further along is larger: a final state beats any step; else the higher step."""
        return (0 if self.state == "active" else 1, self.step)


def split_key(config: TrafficConfig) -> str:
    """The digest of what a split is built from (the same text on every front end)."""
    text = repr((config.canary, config.rollback, config.ab))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sticky_fraction(model: str, key: str) -> float:
    """A key's stable place in [0, 1): the same on every front end and every run."""
    digest = hashlib.sha256(f"{model}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class TrafficSplit:
    def __init__(
        self, model: str, config: TrafficConfig, clock: Clock, rng: random.Random | None = None
    ) -> None:
        self.model = model
        self.config = config
        self.clock = clock
        self.rng = rng or random.Random()  # nosec B311  # splits traffic, guards no secret
        canary = config.canary
        self._schedule: tuple[float, ...] = (canary.steps or (canary.weight,)) if canary is not None else ()
        self._started = clock.now()
        self._step = 0
        self.state = "active"
        self.reason = ""
        """Why the canary was rolled back, once it is."""
        self.key = split_key(config)
        self._judge = CanaryJudge(config.rollback, clock) if canary is not None and config.rollback else None
        self._judged_at = float("-inf")
        self._arms = sorted(config.ab.arms.items()) if config.ab is not None else []

    # ---- choosing -----------------------------------------------------------------------------------
    @property
    def canary_version(self) -> int | None:
        return self.config.canary.version if self.config.canary is not None else None

    @property
    def weight(self) -> float:
        """The canary's share of unversioned requests now (0 once rolled back or without a canary)."""
        if self.state != "active" or not self._schedule:
            return 0.0
        return self._schedule[self._step]

    def pick(self, default: int, sticky_key: str | None = None) -> int:
        """The version for a request that names none; `default` is the model's default version."""
        if self._arms:
            return self._arm(sticky_key)
        canary = self.canary_version
        if canary is None or canary == default or self.weight <= 0.0:
            return default
        return canary if self.rng.random() < self.weight else default

    def _arm(self, sticky_key: str | None) -> int:
        u = sticky_fraction(self.model, sticky_key) if sticky_key is not None else self.rng.random()
        total = 0.0
        for version, share in self._arms:
            total += share
            if u < total:
                return version
        return next(v for v, share in reversed(self._arms) if share > 0)

    # ---- time and outcomes --------------------------------------------------------------------------
    def advance(self) -> Decision | None:
        """Move to the step the clock has reached while healthy; Promote once the last step is 1.0."""
        if self.state != "active" or len(self._schedule) == 0 or self.config.canary is None:
            return None
        canary = self.config.canary
        due = int((self.clock.now() - self._started) // canary.step_interval_s)
        step = min(due, len(self._schedule) - 1)
        if step > self._step:
            self._step = step
            if step == len(self._schedule) - 1 and self._schedule[step] >= 1.0:
                self.state = "promoted"
                return Promote(self.model, canary.version)
            return WeightChanged(self.model, canary.version, self._schedule[step])
        return None

    def judges(self, version: int, default: int) -> bool:
        """Whether a finished call of `version` feeds the judge (an active canary with rollback)."""
        canary = self.canary_version
        if self._judge is None or self.state != "active" or canary is None or canary == default:
            return False
        return version in (canary, default)

    def record(self, version: int, default: int, outcome: str, latency_s: float) -> Decision | None:
        """One finished call of `version`; RolledBack when the judge finds the canary must go."""
        if self._judge is None or not self.judges(version, default):
            return None
        self._judge.record(version == self.canary_version, outcome, latency_s)
        return self.judge()

    def judge(self) -> RolledBack | None:
        """The judge's look, at most once per JUDGE_INTERVAL_S: RolledBack on a breach."""
        canary = self.canary_version
        if self._judge is None or self.state != "active" or canary is None:
            return None
        now = self.clock.now()
        if now - self._judged_at < JUDGE_INTERVAL_S:
            return None
        self._judged_at = now
        breach = self._judge.verdict()
        if breach is None:
            return None
        self.state = "rolled_back"
        self.reason = breach.reason
        return RolledBack(self.model, canary, breach.reason, breach)

    # ---- one decision for several front ends --------------------------------------------------------
    def shared(self) -> SplitState:
        return SplitState(self.key, self._step, self.state, self.reason)

    def merge(self, peer: SplitState) -> Decision | None:
        """Move forward to a peer's state of the same config (never back): its rollback, promotion or
        later step. The step's clock is set back so that the next step comes a full interval later."""
        canary = self.config.canary
        if canary is None or peer.key != self.key or peer.rank <= self.shared().rank:
            return None
        if self.state != "active":
            return None  # final here already: a peer's other final state does not undo it
        last = len(self._schedule) - 1
        self._step = min(peer.step, last)
        if peer.state == "rolled_back":
            self.state, self.reason = "rolled_back", peer.reason
            return RolledBack(self.model, canary.version, peer.reason)
        if peer.state == "promoted":
            self._step, self.state = last, "promoted"
            return Promote(self.model, canary.version)
        self._started = min(self._started, self.clock.now() - self._step * canary.step_interval_s)
        return WeightChanged(self.model, canary.version, self._schedule[self._step])

    def statistics(self, default: int) -> SplitStatistics:
        if self._arms:
            return SplitStatistics(self.model, "ab", dict(self._arms), None, 0, self.state)
        canary = self.canary_version
        if canary is None:
            return SplitStatistics(self.model, "none", {default: 1.0}, None, 0, self.state)
        weights = {default: 1.0 - self.weight, canary: self.weight} if canary != default else {canary: 1.0}
        return SplitStatistics(self.model, "canary", weights, canary, self._step, self.state, self._schedule)
