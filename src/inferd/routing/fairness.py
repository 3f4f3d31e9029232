"""The priority classes, and fairness between tenants inside one class: who gets the next batch slot, and who gets queue
room when the queue is full. Plain objects and functions: no I/O, no clock.

**Batch slots: weighted fair queuing (stride scheduling).** Each backlogged tenant has a virtual time
`pass`; the next slot goes to the lowest pass (ties: the tenant that became backlogged first), which then
advances by 1 / weight. A tenant that becomes backlogged starts at the lowest pass among those already
backlogged (or where the last one left), so idle time earns no credit and costs no penalty.

*Bound.* For any two backlogged tenants i, j: -1/w_j <= pass_i - pass_j <= 1/w_i. (A pick of i needs
pass_i <= pass_j and adds 1/w_i; picks of others leave the difference alone or shrink it; a joining
tenant takes the minimum pass m = pass_k, and pass_j - pass_k <= 1/w_j already held.) Over any stretch in
which both stay backlogged, tenant t's slots S_t equal w_t times the growth of pass_t, so
|S_i / w_i - S_j / w_j| <= 1/w_i + 1/w_j: slot shares converge to weight shares, off by at most one
slot's worth of each tenant at any time. Expired and withdrawn items use no slot and are not charged.

**Queue room: a share of the bound, and displacement.** While the queue has room, every tenant may use
it (the queue stays work-conserving). When it has none, a request of `n` items from tenant t is admitted
if t stays within its share, `held_t + n <= room * w_t / W` (W: the weights of the tenants waiting in
the class, t included; room: what the class may hold), by displacing the newest items of the tenants
that are over their shares. There are always enough: the others hold held - held_t items against shares
of room - share_t, so their excess is at least held + n - room, exactly the items missing. So a tenant
within its share is never refused for queue room, and the tenant that floods the queue is the one
whose requests are refused (429). Each item given up comes from a tenant over its share at that moment;
the rest of that item's request goes with it (the request fails as a whole, so its other items would
only run for nobody). A request that would take its tenant over its share waits for room as before.
With one tenant (no tenants configured) its share is the whole room: nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from inferd.errors import Overloaded, retry_after_s

INTERACTIVE = 0
BULK = 1
PRIORITY_NAMES = {"interactive": INTERACTIVE, "bulk": BULK}
"""The priority classes every kind queues by: bulk uses spare capacity and is shed first."""


@dataclass(frozen=True, slots=True)
class TenantShare:
    """Whose request an item belongs to, and that tenant's weight."""

    name: str
    weight: float = 1.0


NO_TENANT = TenantShare("")
"""Calls without a tenant (none configured): one implicit tenant, served in plain FIFO order."""


class FairOrder:
    """Which backlogged tenant gets the next batch slot (the bound is in the module docstring)."""

    def __init__(self) -> None:
        self._pass: dict[str, float] = {}
        """Backlogged tenants, in the order they became backlogged (the tie-break)."""
        self._weight: dict[str, float] = {}
        self._vtime = 0.0
        """The pass of the latest pick: where a tenant joining an empty class starts."""

    def __contains__(self, tenant: str) -> bool:
        return tenant in self._pass

    def __len__(self) -> int:
        return len(self._pass)

    def tenants(self) -> list[str]:
        return list(self._pass)

    def weights(self) -> dict[str, float]:
        return dict(self._weight)

    def pass_of(self, tenant: str) -> float:
        """A backlogged tenant's virtual time (for inspection)."""
        return self._pass[tenant]

    def join(self, tenant: str, weight: float) -> None:
        """`tenant` has items waiting now (a no-op if it already had): a changed weight (a config
        reload) applies from the next time it becomes backlogged."""
        if tenant not in self._pass:
            self._weight[tenant] = weight
            self._pass[tenant] = min(self._pass.values(), default=self._vtime)

    def leave(self, tenant: str) -> None:
        """`tenant` has nothing waiting any more."""
        self._pass.pop(tenant, None)
        self._weight.pop(tenant, None)

    def next(self) -> str:
        """The tenant whose item takes the next slot (the order must not be empty)."""
        return min(self._pass, key=self._pass.__getitem__)  # min is stable: ties go to the earliest

    def charge(self, tenant: str) -> None:
        """`tenant` took a slot."""
        self._vtime = self._pass[tenant]
        self._pass[tenant] += 1.0 / self._weight[tenant]


def shares(room: int, weights: Mapping[str, float]) -> dict[str, float]:
    """Each tenant's share of `room` items, by weight."""
    total = sum(weights.values())
    return {t: room * w / total for t, w in weights.items()}


def displacement(
    tenant: TenantShare, n: int, free: int, room: int, held: Mapping[str, int], weights: Mapping[str, float]
) -> dict[str, int] | None:
    """How many of their newest items which tenants must give up so `n` items of `tenant` fit: {} when
    they fit in the `free` room, None when they do not and `tenant` would go over its share. `held`
    and `weights`: the class's waiting tenants (live items, weight); `room`: what the class may hold."""
    if n <= free:
        return {}
    weights = {**{t: w for t, w in weights.items() if held.get(t, 0) > 0}, tenant.name: tenant.weight}
    share = shares(room, weights)
    if held.get(tenant.name, 0) + n > share[tenant.name]:
        return None
    left = {t: held[t] for t in weights if t != tenant.name}
    taken: dict[str, int] = {}
    for _ in range(n - free):  # one item at a time from the tenant most over its share
        over = max(left, key=lambda t: (left[t] - share[t], t))
        if left[over] <= share[over]:
            return None  # unreachable by the bound above; refuse rather than take from a tenant in share
        left[over] -= 1
        taken[over] = taken.get(over, 0) + 1
    return taken


def over_share(
    model: str, queued: int, capacity: int, tenant: TenantShare, held: int, drain_s: float
) -> Overloaded:
    """The refusal of a tenant that the full queue has no room for within its share."""
    return Overloaded(
        f"model '{model}' queue is full ({queued}/{capacity} items queued) and tenant '{tenant.name}' "
        f"already holds {held} of them, its share or more; retry in {retry_after_s(drain_s)} s",
        retry_after_s=drain_s,
        reason="queue_full",
    )


def gave_way(model: str, victim: TenantShare, tenant: TenantShare, drain_s: float) -> Overloaded:
    """The answer to an item displaced from the full queue by a tenant within its share."""
    return Overloaded(
        f"model '{model}' queue is full and tenant '{victim.name}' holds more than its share of it: "
        f"its newest request gave way to tenant '{tenant.name}'; retry in {retry_after_s(drain_s)} s",
        retry_after_s=drain_s,
        reason="queue_full",
    )
