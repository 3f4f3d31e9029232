"""Fallback: another model answers a request its own model cannot take.

    [models.sim.traffic]
    fallback = "sim-b"

A request that its model refuses at admission (a queue 429, `Overloaded` with reason queue_full,
llm_queue_full or deadline; a 503, `WorkerUnavailable`) is answered by the fallback model's default
version instead. A tenant's own quota 429 (reason "quota") never falls back: the Quotas layer refuses it
before the model is asked. One hop only: the fallback's own `fallback` is never followed.

A `Breaker` per served version keeps an unavailable primary from being asked on every request: after
`failures` consecutive 503s it opens and requests go straight to the fallback; after `cool_down_s` one
request probes the primary again (half-open); an admission closes it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import TypeVar

from prometheus_client import Counter

from inferd.clock import Clock
from inferd.config import ConfigError, ModelConfig
from inferd.errors import Overloaded, ServingError, WorkerUnavailable
from inferd.runtime.contract import Runtime
from inferd.runtime.kinds import KindRegistry
from inferd.runtime.registry import ModelRegistry

T = TypeVar("T")

FALLBACK_REASONS = frozenset({"queue_full", "llm_queue_full", "deadline"})
"""Overloaded reasons that hand a request to the fallback: the model's own queue or its admission
deadline check. Never "quota" (the tenant's own limit) nor the front end's own saturation."""


def falls_back(exc: ServingError) -> bool:
    """The model refused the request before any work began, for want of capacity: no ready worker, a
    full queue, or a deadline its queue cannot meet."""
    if isinstance(exc, WorkerUnavailable):
        return True
    return isinstance(exc, Overloaded) and exc.reason in FALLBACK_REASONS


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    """Skips a primary that keeps answering 503. Pure policy: an injected clock, no I/O.

    closed --`failures` consecutive failures--> open --`cool_down_s`--> half-open (one probe allowed;
    another after each further cool-down) --success--> closed, --failure--> open."""

    def __init__(self, clock: Clock, failures: int = 3, cool_down_s: float = 5.0) -> None:
        if failures < 1 or cool_down_s <= 0:
            raise ValueError(
                f"breaker needs failures >= 1 and cool_down_s > 0, not {failures}, {cool_down_s}"
            )
        self.clock = clock
        self.failures = failures
        self.cool_down_s = cool_down_s
        self.state = BreakerState.CLOSED
        self._streak = 0
        self._probe_at = 0.0

    def allow(self) -> bool:
        """May the primary be asked now? In the open state, once per cool-down (the probe)."""
        if self.state is BreakerState.CLOSED:
            return True
        now = self.clock.now()
        if now < self._probe_at:
            return False
        self.state = BreakerState.HALF_OPEN
        self._probe_at = now + self.cool_down_s  # a probe that never reports does not wedge it
        return True

    def success(self) -> None:
        self.state = BreakerState.CLOSED
        self._streak = 0

    def failure(self) -> None:
        self._streak += 1
        if self.state is BreakerState.HALF_OPEN or self._streak >= self.failures:
            self.state = BreakerState.OPEN
            self._probe_at = self.clock.now() + self.cool_down_s


def check_fallbacks(
    configs: Iterable[ModelConfig], kinds: Callable[[str], set[str]], registered: KindRegistry
) -> None:
    """A start-up error for a fallback that names an unknown model, itself, or a model whose kind does
    not serve the routes of the model it stands in for (`KindRegistry.same_api`). `kinds(name)`: the
    kinds `name` is served as (empty: not served)."""
    for config in configs:
        target = config.traffic.fallback
        if target is None:
            continue
        where = f"model {config.name!r}: traffic.fallback = {target!r}"
        if target == config.name:
            raise ConfigError(f"{where} names the model itself: name another model, or remove it")
        served = kinds(target)
        if not served:
            raise ConfigError(f"{where} is not a served model: serve {target!r} or remove the fallback")
        allowed = registered.same_api(config.kind)
        if not served <= allowed:
            raise ConfigError(
                f"{where} is a {'/'.join(sorted(served))} model, which cannot answer a {config.kind} "
                f"model's requests: name a {' or '.join(sorted(allowed))} model"
            )


def reason_of(exc: ServingError) -> str:
    return exc.reason if isinstance(exc, Overloaded) else "unavailable"


class Fallbacks:
    """Decides, per request, which runtime takes it: the primary, or its model's fallback. Counts each
    request handed over in `counter` (model, fallback, reason)."""

    def __init__(
        self,
        registry: ModelRegistry,
        kinds: KindRegistry,
        clock: Clock,
        counter: Counter | None = None,
        failures: int = 3,
        cool_down_s: float = 5.0,
    ) -> None:
        self.registry = registry
        self.kinds = kinds
        self.clock = clock
        self.counter = counter
        self.failures = failures
        self.cool_down_s = cool_down_s
        self._breakers: dict[tuple[str, int], Breaker] = {}

    def target(self, primary: Runtime) -> Runtime | None:
        """The fallback's default version, if the primary's model has one served (read from the
        model's default version, like the rest of its traffic table)."""
        name = self.registry.get(primary.name).config.traffic.fallback
        if name is None or name == primary.name or name not in self.registry:
            return None
        fallback = self.registry.get(name)
        return fallback if fallback.kind in self.kinds.same_api(primary.kind) else None

    def breaker(self, primary: Runtime) -> Breaker:
        """The breaker of one served version (each version has its own workers)."""
        key = (primary.name, primary.version)
        breaker = self._breakers.get(key)
        if breaker is None:
            breaker = self._breakers[key] = Breaker(self.clock, self.failures, self.cool_down_s)
        return breaker

    def admit(
        self, primary: Runtime, fallback: Runtime | None, attempt: Callable[[Runtime], T]
    ) -> tuple[Runtime, T]:
        """`attempt` (an admission step: precheck, enqueue) on the primary, else on `fallback` when the
        primary refuses for want of capacity or its breaker is open. The fallback's own refusal is
        raised as it is."""
        if fallback is None:
            return primary, attempt(primary)
        if self.ask_primary(primary, fallback):
            try:
                value = attempt(primary)
            except ServingError as exc:
                if not falls_back(exc):
                    raise
                self.refused(primary, fallback, exc)
            else:
                self.admitted(primary)
                return primary, value
        return fallback, attempt(fallback)

    def ask_primary(self, primary: Runtime, fallback: Runtime) -> bool:
        """Whether to try the primary at all (its breaker is not open); else the fallback takes it."""
        if self.breaker(primary).allow():
            return True
        self._count(primary, fallback, "breaker_open")
        return False

    def admitted(self, primary: Runtime) -> None:
        self.breaker(primary).success()

    def refused(self, primary: Runtime, fallback: Runtime, exc: ServingError) -> None:
        """The primary refused a request that `fallback` now takes (also later than `admit`, e.g. at
        enqueue): a 503 counts towards opening its breaker."""
        if isinstance(exc, WorkerUnavailable):
            self.breaker(primary).failure()
        self._count(primary, fallback, reason_of(exc))

    def _count(self, primary: Runtime, fallback: Runtime, reason: str) -> None:
        if self.counter is not None:
            self.counter.labels(primary.name, fallback.name, reason).inc()
