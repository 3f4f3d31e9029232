"""Where quota state lives, and the engine that runs the quota policy against it.

A store does one thing: apply a step atomically to one key. The step is the policy itself
(gateway/quotas.py), given the key's current state and the store's time, returning a result and the new
state; so the quota arithmetic has one implementation whichever store holds the state. `InProcessStore`
(the default) keeps the state in a dict (one front end); `RedisStore` (gateway/redis_store.py) shares it
between front ends, its time is the Redis server's (one clock for every front end), and its atomicity is
a compare-and-set Lua script: a step that lost a race to another front end runs again on the new state,
so concurrent front ends cannot overshoot a limit.

When the store cannot be reached, `[gateway] on_store_error` decides: "open" (the default) admits
without quotas, "closed" refuses with a retryable 503. Either way the change is logged once, and once
more when the store is back.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from inferd.clock import Clock, MonotonicClock
from inferd.config.tenants import TenantConfig
from inferd.core.tenant import Tenant
from inferd.errors import Overloaded
from inferd.gateway.quotas import Grant, QuotaDecision, QuotaPolicy, QuotaState

EMPTY_STATE = QuotaState()

log = logging.getLogger(__name__)

T = TypeVar("T")
Step = Callable[[QuotaState, float], tuple[T, QuotaState | None]]
"""One atomic change of a tenant's state (given the empty state when there is none); None drops it.
A shared store encodes the state on its way out and decodes it on its way in; the in-process store
keeps the value itself."""
"""(current state or None, the store's time in seconds) -> (result, new state or None to delete)."""


class StoreUnavailable(Exception):
    """The quota store could not be reached (the engine turns this into `on_store_error`'s answer)."""


class QuotaStore(Protocol):
    async def update(self, key: str, step: Step[T], keep_s: float) -> T:
        """Apply `step` to `key` atomically; the new state is kept at least `keep_s` seconds after this
        update. Raises StoreUnavailable when the store cannot be reached."""
        ...

    async def close(self) -> None: ...


class InProcessStore:
    """Quota state in this process. Atomic because `update` never awaits between read and write."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._data: dict[str, QuotaState] = {}

    async def update(self, key: str, step: Step[T], keep_s: float) -> T:
        result, new = step(self._data.get(key) or EMPTY_STATE, self._clock.now())
        if new is None:
            self._data.pop(key, None)
        else:
            self._data[key] = new
        return result

    async def close(self) -> None:
        self._data.clear()


class QuotaSettings(BaseModel):
    """The quota settings of the `[gateway]` table."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    redis_url: str | None = None
    """Share quotas between front ends through this Redis (`redis://HOST:6379/0`; needs the inferd[redis]
    extra). None: each front end keeps its own quota state in process."""
    redis_timeout_ms: int = Field(default=250, ge=1, le=60_000)
    """How long one Redis call may take before the store counts as unreachable."""
    on_store_error: Literal["open", "closed"] = "open"
    """When the quota store is unreachable: "open" admits requests without quotas (serving goes on,
    limits are not enforced), "closed" refuses them with a retryable 503 (limits hold, serving stops)."""
    lease_s: float = Field(default=600.0, gt=0.0)
    """An in-flight request not released after this long (its front end died) stops counting against
    max_concurrency."""
    key_prefix: str = "inferd:quota:"
    """Prefix of the Redis keys (one per tenant)."""


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One limited tenant's quota decisions on this front end."""

    admitted: int = 0
    refused: int = 0
    admitted_without_store: int = 0
    """Admitted unchecked while the store was unreachable (on_store_error = "open")."""
    in_flight: int = 0
    """Admitted requests of this front end not yet released (with a shared store, other front ends'
    requests count against max_concurrency too)."""


@dataclass(frozen=True, slots=True)
class QuotaStatistics:
    admitted: int
    refused: int
    store_errors: int
    admitted_without_store: int
    store_up: bool
    tenants: tuple[tuple[str, TenantUsage], ...] = ()
    """(tenant name, its usage), by name; only tenants with a limit pass through the engine."""


def limited(config: TenantConfig) -> bool:
    return any(
        value is not None for value in (config.requests_per_s, config.tokens_per_min, config.max_concurrency)
    )


class TenantQuotas:
    """Admits and releases requests of tenants against their limits, through a store."""

    def __init__(self, store: QuotaStore, settings: QuotaSettings, clock: Clock | None = None) -> None:
        self.store = store
        self.settings = settings
        self._clock = clock or MonotonicClock()
        self._policies: dict[str, QuotaPolicy] = {}
        self._store_up = True
        self._counts = {"admitted": 0, "refused": 0, "store_errors": 0, "admitted_without_store": 0}
        self._tenants: dict[str, dict[str, int]] = {}
        self._in_flight: dict[str, set[str]] = {}
        """Lease ids of each tenant's admitted requests not yet released, on this front end."""

    async def admit(self, tenant: Tenant, tokens: int | None = None) -> QuotaDecision:
        """Admit one request of `tenant` (`tokens`: prompt + max_tokens on LLM routes) or refuse it
        (a decision with retry_after_s). Raises Overloaded when the store is unreachable and
        on_store_error is "closed"."""
        lease_id = secrets.token_hex(8)
        if not limited(tenant.config):
            return QuotaDecision(allowed=True, at_s=self._clock.now(), grant=Grant(lease_id))
        policy = self._policy(tenant)

        def step(state: QuotaState, now: float) -> tuple[QuotaDecision, QuotaState | None]:
            return policy.admit(state, now, lease_id, tokens)

        try:
            decision = await self.store.update(self._key(tenant), step, policy.keep_s())
        except StoreUnavailable as exc:
            return self._without_store(tenant, lease_id, exc)
        self._store_back()
        result = "admitted" if decision.allowed else "refused"
        self._counts[result] += 1
        self._count(tenant, result, decision.grant)
        return decision

    async def release(self, tenant: Tenant, grant: Grant, used_tokens: int | None = None) -> None:
        """End an admitted request: free its concurrency lease and refund its unused tokens. When the
        store is unreachable the lease expires after lease_s instead (logged)."""
        self._in_flight.get(tenant.name, set()).discard(grant.lease_id)
        if not grant.held:
            return
        policy = self._policy(tenant)

        def step(state: QuotaState, now: float) -> tuple[None, QuotaState | None]:
            return None, policy.release(state, now, grant, used_tokens)

        try:
            await self.store.update(self._key(tenant), step, policy.keep_s())
        except StoreUnavailable as exc:
            self._store_down(exc)
            return
        self._store_back()

    def statistics(self) -> QuotaStatistics:
        tenants = tuple(
            (name, TenantUsage(**counts, in_flight=len(self._in_flight.get(name, ()))))
            for name, counts in sorted(self._tenants.items())
        )
        return QuotaStatistics(store_up=self._store_up, tenants=tenants, **self._counts)

    def _count(self, tenant: Tenant, result: str, grant: Grant | None) -> None:
        """Per-tenant counts (tenants come from the config file: a bounded set); `grant`: an admitted
        request, in flight until released."""
        counts = self._tenants.get(tenant.name)
        if counts is None:
            counts = self._tenants[tenant.name] = dict.fromkeys(
                ("admitted", "refused", "admitted_without_store"), 0
            )
        counts[result] += 1
        if grant is not None:
            self._in_flight.setdefault(tenant.name, set()).add(grant.lease_id)

    def _policy(self, tenant: Tenant) -> QuotaPolicy:
        policy = self._policies.get(tenant.name)
        if policy is None or policy.limits is not tenant.config:
            policy = QuotaPolicy(tenant.config, self.settings.lease_s)
            self._policies[tenant.name] = policy
        return policy

    def _key(self, tenant: Tenant) -> str:
        return f"{self.settings.key_prefix}{tenant.name}"

    def _without_store(self, tenant: Tenant, lease_id: str, exc: StoreUnavailable) -> QuotaDecision:
        self._store_down(exc)
        if self.settings.on_store_error == "closed":
            raise Overloaded(
                f"quota store unreachable ({exc}); requests of tenant {tenant.name!r} are refused "
                'while it is down ([gateway] on_store_error = "closed")',
                retry_after_s=1.0,
                reason="quota_store",
            ) from exc
        self._counts["admitted_without_store"] += 1
        grant = Grant(lease_id)
        self._count(tenant, "admitted_without_store", grant)
        return QuotaDecision(allowed=True, at_s=self._clock.now(), grant=grant)

    def _store_down(self, exc: StoreUnavailable) -> None:
        self._counts["store_errors"] += 1
        if self._store_up:
            self._store_up = False
            answer = "admitted without quotas" if self.settings.on_store_error == "open" else "refused (503)"
            log.warning("quota store unreachable (%s): requests are %s until it is back", exc, answer)

    def _store_back(self) -> None:
        if not self._store_up:
            self._store_up = True
            log.warning("quota store reachable again: quotas are enforced")
