"""Tenants in the simulator: each arrival belongs to a tenant (drawn by the tenants' shares of the
traffic), passes the gateway's own quota policy (gateway/quotas.py `QuotaPolicy`: requests per second
with a burst, concurrency; a pure object whose state is a value) at the virtual time it arrives, and
queues in its tenant's lane with its weight (routing/fairness.py), as `Quotas` and `tenant_share` do in
the server. A refused arrival is the tenant's 429; an admitted one releases its lease when answered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from inferd.config.tenants import TenantConfig
from inferd.gateway.quotas import Grant, QuotaPolicy, QuotaState
from inferd.routing.fairness import TenantShare


@dataclass(frozen=True, slots=True)
class SimTenant:
    name: str
    share: float
    """Its share of the arrivals."""
    limits: TenantConfig


class SimTenants:
    def __init__(self, tenants: list[SimTenant], arrivals: int, seed: int) -> None:
        if not tenants or any(t.share <= 0 for t in tenants):
            raise ValueError("tenants need positive shares of the traffic")
        self.tenants = tenants
        shares = np.array([t.share for t in tenants], dtype=float)
        self.of = np.random.default_rng(seed + 17).choice(
            len(tenants), size=arrivals, p=shares / shares.sum()
        )
        self.policies = [QuotaPolicy(t.limits) for t in tenants]
        self.states = [QuotaState() for _ in tenants]
        self.shares = [TenantShare(t.name, t.limits.weight) for t in tenants]
        self.grants: dict[int, Grant] = {}

    def admit(self, rid: int, now: float) -> TenantShare | None:
        """The request's lane, or None when its tenant's quota refuses it."""
        i = int(self.of[rid])
        decision, self.states[i] = self.policies[i].admit(self.states[i], now, f"r{rid}")
        if not decision.allowed:
            return None
        if decision.grant is not None and decision.grant.held:
            self.grants[rid] = decision.grant
        return self.shares[i]

    def release(self, rid: int, now: float) -> None:
        grant = self.grants.pop(rid, None)
        if grant is not None:
            i = int(self.of[rid])
            self.states[i] = self.policies[i].release(self.states[i], now, grant, None)

    def summary(
        self, ok: np.ndarray, limited: np.ndarray, latency_ms: np.ndarray, window: np.ndarray
    ) -> dict[str, Any]:
        out = {}
        for i, t in enumerate(self.tenants):
            mine = window & (self.of == i)
            done = mine & ok
            values = latency_ms[done]
            out[t.name] = {
                "requests": int(mine.sum()),
                "ok": int(done.sum()),
                "limited": int((mine & limited).sum()),
                "p99_ms": round(float(np.percentile(values, 99)), 3) if values.size else None,
            }
        return out
