"""frontends/sync.py OwnerLease: front end 0's hold on the decider lease for --frontends N (until
cluster/lease.py's keeper is wired there), on MemoryStore and a fake clock."""

from __future__ import annotations

from typing import Any

from inferd.clock import FakeClock
from inferd.cluster.memory import MemoryStore
from inferd.cluster.store import StoreUnavailable
from inferd.frontends.sync import LEASE, LEASE_TTL_S, OwnerLease


class Down(MemoryStore):
    down = False

    async def acquire(self, lease: str, holder: str, ttl_s: float) -> Any:
        if self.down:
            raise StoreUnavailable("down for the test")
        return await super().acquire(lease, holder, ttl_s)


async def test_the_owner_holds_the_lease_while_it_renews_and_lets_it_go_within_its_ttl() -> None:
    clock = FakeClock()
    store = Down(clock)
    owner, other = OwnerLease(store, "0", True, clock), OwnerLease(store, "1", False, clock)
    assert owner.grant() is None
    await owner.renew()
    grant = owner.grant()
    assert grant is not None and (grant.holder, grant.lease) == ("0", LEASE)
    assert other.grant() is None
    clock.advance(LEASE_TTL_S / 3)
    await owner.renew()
    assert owner.grant() == grant  # the same epoch, renewed
    store.down = True
    clock.advance(LEASE_TTL_S / 3)
    await owner.renew()
    assert owner.grant() == grant  # still within the ttl of its last renewal
    clock.advance(LEASE_TTL_S * 2 / 3)
    assert owner.grant() is None  # it stops acting as holder once its time is up
    store.down = False
    await owner.renew()
    again = owner.grant()
    assert again is not None and again.epoch == grant.epoch + 1
