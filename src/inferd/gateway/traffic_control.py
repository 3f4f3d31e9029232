"""`Traffic`: the server's traffic splits, one `TrafficSplit` per model whose default version's config
has a canary or an A/B table. The API asks it which version answers a request that names none
(`Traffic.choose`, from `Api.resolve`), the accounting layer feeds it each call's outcome
(`Traffic.observe`), and it carries out the splits' decisions: a promoted canary becomes the default
version, a rolled-back one goes to weight 0; each is logged once with its reason, counted in
`inferd_traffic_*` metrics and kept in a history that `statistics()` returns.

The splits are read at start from each model's default version. A reload of the config file that
changes a model's canary, rollback or A/B table (`Traffic.reload`) replaces its split: a canary starts
again at its first step (a rolled-back one at its weight again). A reload that leaves them as they were
keeps the split's state, rolled back included. The history and the per-version counters always stay.

With several front ends, the lease holder's `Traffic` decides for the server and the others are
followers (`follower` True): a follower neither steps nor judges, it keeps the outcomes it sees for the
judge (`take_outcomes`, judged there by `absorb`) and applies the holder's states (`merge`); the holder
steps on its clock (`tick`). gateway/canary_share.py carries both ways through the shared store, and
sets `follower` as the lease moves.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from inferd.clock import Clock
from inferd.config import ConfigError, ModelConfig
from inferd.config.traffic import TrafficConfig
from inferd.gateway.canary_judge import MAX_SAMPLES
from inferd.gateway.traffic import (
    Decision,
    Promote,
    RolledBack,
    SplitState,
    SplitStatistics,
    TrafficSplit,
)
from inferd.observability.traffic_metrics import TrafficMetrics
from inferd.runtime.contract import Runtime
from inferd.runtime.registry import ModelRegistry

log = logging.getLogger("inferd.traffic")

HISTORY = 50
"""Rollbacks and promotions kept for `inferd status` and the admin API."""


@dataclass(frozen=True, slots=True)
class TrafficEvent:
    model: str
    version: int
    event: str
    """"rolled_back", "promoted", "step" or "reloaded" (the config file changed the table)."""
    reason: str
    at: float
    """Wall-clock time (Unix seconds)."""


Outcome = tuple[int, str, float]
"""(version, outcome label, latency in seconds) of one finished call, as a follower sends it."""


@dataclass(frozen=True, slots=True)
class Outcomes:
    """A follower's outcomes of one model's split since its last sync, under the split's key."""

    key: str
    outcomes: list[Outcome]


@dataclass(frozen=True, slots=True)
class TrafficStatistics:
    splits: tuple[SplitStatistics, ...]
    history: tuple[TrafficEvent, ...]
    """Newest last."""


def _splits(config: TrafficConfig) -> bool:
    return config.canary is not None or config.ab is not None


def _split_part(config: TrafficConfig) -> tuple[object, ...]:
    """What a split is built from (shadow and fallback are read per request, elsewhere)."""
    return (config.canary, config.rollback, config.ab)


def check_traffic(models: Iterable[ModelConfig]) -> None:
    """Every version a model's traffic table (its default version's) names is served; else a
    ConfigError naming the served versions and the fix."""
    by_name: dict[str, dict[int, ModelConfig]] = {}
    for m in models:
        by_name.setdefault(m.name, {})[m.version] = m
    for name, configs in by_name.items():
        served = sorted(configs)
        pinned = next((c.default_version for c in configs.values() if c.default_version), None)
        default = pinned if pinned in configs else served[-1]
        traffic = configs[default].traffic
        if traffic.canary is not None and traffic.canary.version == default:
            raise ConfigError(
                f"model {name!r}: the traffic canary version {default} is the default version; set "
                f"default_version to the version it is compared with (served versions: {served})"
            )
        named = []
        if traffic.canary is not None:
            named.append(("canary", traffic.canary.version))
        if traffic.ab is not None:
            named.extend(("ab arm", v) for v in traffic.ab.arms)
        if traffic.shadow is not None:
            named.append(("shadow", traffic.shadow.version))
        for what, version in named:
            if version not in served:
                raise ConfigError(
                    f"model {name!r}: the traffic {what} version {version} is not served (served "
                    f"versions: {served}); serve it (a version folder or [versions.{version}] with "
                    f'version_policy = "all" or specific) or change the traffic table'
                )


class Traffic:
    def __init__(
        self,
        registry: ModelRegistry,
        clock: Clock,
        metrics: TrafficMetrics,
        rng: random.Random | None = None,
        wall_clock: Callable[[], float] = time.time,
        follower: bool = False,
    ) -> None:
        check_traffic(rt.config for rt in registry)
        self.follower = follower
        """One of several front ends that does not hold the lease: the holder's splits decide (module doc;
        gateway/canary_share.py sets it as the lease moves)."""
        self._outbox: dict[str, deque[Outcome]] = {}
        self.registry = registry
        self.metrics = metrics
        self.wall_clock = wall_clock
        self.clock = clock
        self.rng = rng or random.Random()  # nosec B311  # splits traffic, guards no secret
        self.splits: dict[str, TrafficSplit] = {
            rt.name: self._split(rt.name, rt.config.traffic)
            for rt in registry.defaults()
            if _splits(rt.config.traffic)
        }
        self.history: deque[TrafficEvent] = deque(maxlen=HISTORY)
        for name, split in self.splits.items():
            self._publish_weights(name, split)
            stats = split.statistics(registry.default_version(name))
            shares = ", ".join(f"v{v} {w:g}" for v, w in sorted(stats.weights.items()))
            log.info("traffic: %s split for %r: %s", stats.mode, name, shares)

    def _split(self, name: str, config: TrafficConfig) -> TrafficSplit:
        return TrafficSplit(name, config, self.clock, random.Random(self.rng.random()))  # nosec B311

    def reload(self, name: str) -> str:
        """The traffic table of `name`'s default version changed on a reload (its runtimes' configs hold
        the new one): a changed canary, rollback or A/B table replaces the split; an unchanged one keeps
        its state (only shadow or fallback changed). Returns what happened, for the reload's answer."""
        config = self.registry.get(name).config.traffic
        split = self.splits.get(name)
        if split is not None and _split_part(split.config) == _split_part(config):
            return "split unchanged (shadow or fallback changed)"
        default = self.registry.default_version(name)
        if not _splits(config):
            if split is None:
                return "no split (shadow or fallback changed)"
            del self.splits[name]
            self._outbox.pop(name, None)
            what = "split removed: unversioned requests go to the default version"
            for version in self.registry.versions(name):
                self.metrics.weight(name, version, 1.0 if version == default else 0.0)
        else:
            split = self.splits[name] = self._split(name, config)
            self._outbox.pop(name, None)  # outcomes of the replaced split
            self._publish_weights(name, split)
            stats = split.statistics(default)
            shares = ", ".join(f"v{v} {w:g}" for v, w in sorted(stats.weights.items()))
            what = f"{stats.mode} split replaced: {shares}" + (
                ", steps restart" if config.canary and config.canary.steps else ""
            )
        log.info("traffic: reload: %r %s", name, what)
        self._event(name, (split.canary_version or default) if split else default, "reloaded", what)
        return what

    def choose(self, name: str, tenant: str | None, metadata: Callable[[bytes], str | None]) -> int | None:
        """The version for a request to `name` that names no version (None: the default, no split).
        `tenant`: the authenticated tenant's name (None: anonymous); `metadata`: the caller's metadata by
        lower-case name (an HTTP edge's headers), for an A/B split sticky by `header:NAME`."""
        split = self.splits.get(name)
        if split is None:
            return None
        if not self.follower:
            self._apply(split.advance())
        key = None
        ab = split.config.ab
        if ab is not None:
            if ab.sticky_by == "tenant":
                key = tenant
            else:
                key = metadata(ab.sticky_by[len("header:") :].lower().encode())
        default = self.registry.default_version(name)
        version = split.pick(default, key)
        if version not in self.registry.versions(name):  # retired since start (an update): the default
            version = default
        self.metrics.assigned(name, version)
        return version

    def observe(self, rt: Runtime, outcome: str, latency_s: float) -> None:
        """One finished call of a model version (from the accounting layer)."""
        split = self.splits.get(rt.name)
        if split is None:
            return
        default = self.registry.default_version(rt.name)
        if not self.follower:
            self._apply(split.record(rt.version, default, outcome, latency_s))
        elif split.judges(rt.version, default):
            outbox = self._outbox.setdefault(rt.name, deque(maxlen=MAX_SAMPLES))
            outbox.append((rt.version, outcome, latency_s))

    # ---- one decision for several front ends (gateway/canary_share.py) --------------------------------
    def shared(self) -> dict[str, SplitState]:
        """Each canary split's state, for the other front ends."""
        return {name: s.shared() for name, s in self.splits.items() if s.canary_version is not None}

    def merge(self, states: dict[str, SplitState]) -> None:
        """Move each split forward to another front end's state of the same config (never back)."""
        for name, state in states.items():
            split = self.splits.get(name)
            if split is not None:
                self._apply(split.merge(state))

    def take_outcomes(self) -> dict[str, Outcomes]:
        """A follower's outcomes since the last call (the outbox is emptied)."""
        taken = {
            name: Outcomes(self.splits[name].key, list(box))
            for name, box in self._outbox.items()
            if box and name in self.splits
        }
        self._outbox.clear()
        return taken

    def absorb(self, outcomes: dict[str, Outcomes]) -> None:
        """The judge takes a follower's outcomes with its own (those of another config are dropped)."""
        for name, sent in outcomes.items():
            split = self.splits.get(name)
            if split is None or split.key != sent.key:
                continue
            default = self.registry.default_version(name)
            for version, outcome, latency_s in sent.outcomes:
                self._apply(split.record(version, default, outcome, latency_s))

    def tick(self) -> None:
        """The holder's periodic look: steps due and the judges' verdicts, without waiting for traffic."""
        for split in list(self.splits.values()):
            self._apply(split.advance())
            self._apply(split.judge())

    def _apply(self, decision: Decision | None) -> None:
        if decision is None:
            return
        split = self.splits[decision.model]
        if isinstance(decision, RolledBack):
            log.warning(
                "traffic: canary %r version %d rolled back to weight 0: %s",
                decision.model,
                decision.version,
                decision.reason,
            )
            if decision.breach is not None:  # judged here (a merged one is counted where judged)
                self.metrics.rolled_back(decision.model)
            self._event(decision.model, decision.version, "rolled_back", decision.reason)
        elif isinstance(decision, Promote):
            previous = self.registry.default_version(decision.model)
            self.registry.set_default(decision.model, decision.version)
            log.info(
                "traffic: canary %r version %d reached weight 1.0 and is the default version (was %d)",
                decision.model,
                decision.version,
                previous,
            )
            self._event(decision.model, decision.version, "promoted", f"default version was {previous}")
        else:
            log.info(
                "traffic: canary %r version %d moves to weight %g",
                decision.model,
                decision.version,
                decision.weight,
            )
            self._event(decision.model, decision.version, "step", f"weight {decision.weight:g}")
        self._publish_weights(decision.model, split)

    def _event(self, model: str, version: int, event: str, reason: str) -> None:
        self.history.append(TrafficEvent(model, version, event, reason, self.wall_clock()))

    def _publish_weights(self, name: str, split: TrafficSplit) -> None:
        stats = split.statistics(self.registry.default_version(name))
        for version in self.registry.versions(name):
            self.metrics.weight(name, version, stats.weights.get(version, 0.0))

    def statistics(self) -> TrafficStatistics:
        splits = tuple(
            split.statistics(self.registry.default_version(name)) for name, split in self.splits.items()
        )
        return TrafficStatistics(splits, tuple(self.history))
