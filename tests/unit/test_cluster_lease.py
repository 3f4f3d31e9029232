"""The lease of single-actor decisions (cluster/lease.py) on a fake clock: when a front end renews, when
it stops acting as the holder, and what the store does with a deposed holder's late write (fencing) and
with concurrent writers (compare-and-set)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from inferd.clock import FakeClock, MonotonicClock
from inferd.cluster.follower import Document
from inferd.cluster.lease import LEASE, TTL_S, LeaseCollector, LeaseKeeper, keep_lease
from inferd.cluster.memory import MemoryState, MemoryStore
from inferd.cluster.store import Fenced, Grant, RevisionConflict


def told(keeper: LeaseKeeper, state: MemoryState, started_at: float | None = None) -> Grant | None:
    """One try: started at `started_at` (now by default), answered now by `state`."""
    keeper.granted(keeper.clock.now() if started_at is None else started_at, state.acquire(keeper.lease, keeper.holder, keeper.ttl_s))
    return keeper.grant()


def test_a_holder_renews_every_third_of_its_ttl_and_keeps_its_epoch() -> None:
    clock = FakeClock()
    state, keeper = MemoryState(clock), LeaseKeeper("a", clock)
    assert keeper.grant() is None and keeper.wait_s() == pytest.approx(TTL_S / 3)
    first = told(keeper, state)
    assert first == Grant(LEASE, "a", 1, TTL_S)
    for _ in range(10):
        clock.advance(keeper.wait_s())
        assert told(keeper, state) == first  # renewed: the same epoch


def test_a_holder_that_cannot_renew_stops_acting_within_its_lease_time() -> None:
    clock = FakeClock()
    state, keeper = MemoryState(clock), LeaseKeeper("a", clock, ttl_s=5.0, margin=0.1)
    started = clock.now()
    clock.advance(1.0)  # the answer took a second: the lease is counted from the request's start
    assert told(keeper, state, started) is not None
    clock.advance(3.0)
    keeper.failed(clock.now())  # the store does not answer
    assert keeper.grant() is not None  # 4.0 s since the start < 4.5 s
    clock.advance(0.6)
    keeper.failed(clock.now())
    assert keeper.grant() is None  # 4.6 s > ttl less its margin: it stops acting
    assert state.holder(LEASE) is not None  # while the store still counts it held: nobody else acts yet


def test_another_front_end_gets_the_lease_once_it_expired_with_the_next_epoch() -> None:
    clock = FakeClock()
    state = MemoryState(clock)
    a, b = LeaseKeeper("a", clock), LeaseKeeper("b", clock)
    assert told(a, state) is not None
    assert told(b, state) is None  # a holds it
    clock.advance(TTL_S + 0.1)  # a could not renew
    assert a.grant() is None
    taken = told(b, state)
    assert taken is not None and taken.epoch == 2
    assert told(a, state) is None  # a's store answers again: b holds it now


def test_a_deposed_holders_late_write_is_refused() -> None:
    clock = FakeClock()
    state = MemoryState(clock)
    old = state.acquire(LEASE, "a", TTL_S)
    assert old is not None
    assert state.write("served", b"1", fence=old) == 1
    clock.advance(TTL_S + 0.1)
    new = state.acquire(LEASE, "b", TTL_S)
    assert new is not None and new.epoch == old.epoch + 1
    with pytest.raises(Fenced, match="b holds epoch 2"):
        state.write("served", b"late", fence=old)
    with pytest.raises(Fenced):
        state.delete("served", fence=old)
    assert state.write("served", b"2", fence=new) == 2
    assert state.read("served").body == b"2"  # type: ignore[union-attr]
    state.release(new)
    again = state.acquire(LEASE, "a", TTL_S)
    assert again is not None and again.epoch == 3  # epochs never go back, even after a release


class Counter(msgspec.Struct, frozen=True):
    n: int = 0


async def test_compare_and_set_refuses_a_stale_revision_and_update_retries_on_it() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    doc = Document("counter", Counter, Counter)
    assert await store.write("counter", doc.encode(Counter(1)), expect=0) == 1
    with pytest.raises(RevisionConflict):
        await store.write("counter", doc.encode(Counter(5)), expect=0)  # it exists now

    class Racing(MemoryStore):
        """Another writer slips in between each read and the write, twice."""

        raced = 0

        async def write(self, name: str, body: bytes, **kwargs: object) -> int:
            if self.raced < 2:
                self.raced += 1
                self.state.write(name, doc.encode(Counter(100 + self.raced)))
            return await super().write(name, body, **kwargs)  # type: ignore[arg-type]

    racing = Racing(clock, store.state)
    revision, value = await doc.update(racing, lambda c: Counter(c.n + 1))
    assert value == Counter(103) and revision == 4  # applied to the other writer's latest value
    assert (await doc.read(store)) == (4, Counter(103))


async def test_the_driver_holds_the_lease_then_releases_it_when_cancelled() -> None:
    store = MemoryStore(MonotonicClock())
    keeper = LeaseKeeper("a", MonotonicClock(), ttl_s=0.3)
    registry = CollectorRegistry()
    registry.register(LeaseCollector(keeper))
    task = asyncio.create_task(keep_lease(keeper, store))
    for _ in range(200):
        if keeper.grant() is not None:
            break
        await asyncio.sleep(0.01)
    assert keeper.grant() is not None and (await store.holder(LEASE)) is not None
    assert registry.get_sample_value("inferd_cluster_lease_holder") == 1.0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert keeper.grant() is None and await store.holder(LEASE) is None  # the next holder need not wait
    assert registry.get_sample_value("inferd_cluster_lease_holder") == 0.0
