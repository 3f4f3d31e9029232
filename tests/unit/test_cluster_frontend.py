"""Where a change asked of one front end of many is carried out (cluster/frontend.py's `decider`), on a
MemoryStore and a fake clock: at the holder's admin address when another holds the lease, here when
this one holds it, and a 503 naming the store when the store does not answer (not "another may hold
the lease": the client is told what is wrong)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inferd.clock import FakeClock
from inferd.cluster.frontend import ClusterFrontend, Seat
from inferd.cluster.lease import LEASE
from inferd.cluster.members import Member
from inferd.cluster.memory import MemoryStore
from inferd.cluster.store import Grant, StoreUnavailable
from inferd.config import ServerConfig
from inferd.errors import ClusterUnavailable
from inferd.kinds.builtin import builtin_kinds
from inferd.runtime.registry import ModelRegistry


class Switchable(MemoryStore):
    """A MemoryStore that stops answering while `down`."""

    down = False

    async def holder(self, lease: str) -> Grant | None:
        if self.down:
            raise StoreUnavailable("the cluster store at redis://10.0.0.7:6379/0: Connection refused")
        return await super().holder(lease)


def front_end(store: MemoryStore, clock: FakeClock, me: str, others: dict[str, str]) -> ClusterFrontend:
    async def refresh() -> None:  # the records are as given
        return None

    records = {m: Member(id=m, admin=admin) for m, admin in others.items()}
    members = SimpleNamespace(members=records, refresh=refresh)
    server = SimpleNamespace(
        config=ServerConfig(), registry=ModelRegistry(), kinds=builtin_kinds(), model_control=SimpleNamespace(share=lambda versions: None)
    )
    seat = Seat(store=store, me=me, index=-1, count=None, members=members)  # type: ignore[arg-type]
    return ClusterFrontend(seat, server, clock, contends=True)


async def test_a_change_goes_to_the_holder_or_answers_503_naming_the_store_when_it_is_down() -> None:
    clock = FakeClock()
    store = Switchable(clock)
    b = front_end(store, clock, "fe-b", {"fe-a": "10.0.0.2:8001"})
    assert await b.decider() is None  # nobody holds the lease: refused here (check_holder)
    await store.acquire(LEASE, "fe-a", 5.0)
    assert await b.decider() == "10.0.0.2:8001"

    store.down = True
    with pytest.raises(ClusterUnavailable, match=r"the cluster store does not answer \(the cluster store at redis://10\.0\.0\.7:6379/0"):
        await b.decider()

    a = front_end(store, clock, "fe-a", {})
    assert a.keeper is not None
    a.keeper.granted(clock.now(), Grant(LEASE, "fe-a", 1, 5.0))
    assert await a.decider() is None  # the holder carries it out itself, without asking the store
