"""`inferd_cluster_store_up` follows the follow loop's view of the store, at each scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from inferd.clock import FakeClock
from inferd.cluster.follower import Follower
from inferd.cluster.memory import MemoryStore
from inferd.cluster.metrics import StoreCollector
from inferd.cluster.store import StoreUnavailable, Versioned


class Away(MemoryStore):
    """A store that stops answering when told."""

    away = False

    async def read(self, doc: str) -> Versioned | None:
        if self.away:
            raise StoreUnavailable("away")
        return await super().read(doc)


async def _nothing(found: Versioned | None) -> None:
    return None


async def test_the_gauge_is_0_while_the_store_does_not_answer_and_1_once_it_does() -> None:
    clock = FakeClock()
    store = Away(clock)
    follower = Follower(store, clock)
    follower.follow("served", _nothing)
    registry = CollectorRegistry()
    registry.register(StoreCollector(lambda: follower.up))
    assert await follower.read_all()
    assert registry.get_sample_value("inferd_cluster_store_up") == 1
    store.away = True
    assert not await follower.read_all()
    assert registry.get_sample_value("inferd_cluster_store_up") == 0
    store.away = False
    assert await follower.read_all()
    assert registry.get_sample_value("inferd_cluster_store_up") == 1
