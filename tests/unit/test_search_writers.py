"""The writer of a search index: the holder of its lease `search-writer/<index>` (kinds/search/writers.py),
on a MemoryStore and a FakeClock."""

from __future__ import annotations

import asyncio

import pytest

from inferd.clock import FakeClock
from inferd.cluster.memory import MemoryStore
from inferd.kinds.search.writers import IndexWriter, keep_writer_lease, writer_lease

TTL = 3.0


async def _try(writer: IndexWriter, store: MemoryStore) -> None:
    """One try of the driver's loop, by hand."""
    started = writer.clock.now()
    if writer.contends:
        writer.granted(started, await store.acquire(writer.lease, writer.me, writer.ttl_s))
    if writer.epoch() is None:
        writer.heard(started, await store.holder(writer.lease))


def test_the_lease_is_named_per_index() -> None:
    assert writer_lease("docs") == "search-writer/docs"
    assert writer_lease("docs") != writer_lease("other")
    assert IndexWriter("docs", "a", FakeClock()).lease == "search-writer/docs"


async def test_the_holder_writes_only_once_its_takeover_is_done() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a = IndexWriter("docs", "a", clock, TTL)
    await _try(a, store)
    epoch = a.taking_over()
    assert epoch is not None
    assert not a.writes() and a.writer() is None  # no writer while it takes over
    a.took_over(epoch)
    assert a.writes() and a.writer() == "a" and a.taking_over() is None


async def test_another_front_end_learns_who_writes_and_forgets_it_when_the_grant_runs_out() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a, b = IndexWriter("docs", "a", clock, TTL), IndexWriter("docs", "b", clock, TTL)
    await _try(a, store)
    a.took_over(a.taking_over() or 0)
    await _try(b, store)
    assert b.epoch() is None and not b.writes()
    assert b.writer() == "a"
    assert b.retry_after_s() == TTL
    clock.advance(TTL + 0.1)  # a renewed nothing: its grant ran out, and b heard nothing since
    assert b.writer() is None
    assert not a.writes()  # a lapsed before the store could give the lease away


async def test_a_resumed_old_writer_is_refused_and_the_new_one_takes_over_under_a_new_epoch() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a, b = IndexWriter("docs", "a", clock, TTL), IndexWriter("docs", "b", clock, TTL)
    await _try(a, store)
    old = a.taking_over()
    assert old is not None
    a.took_over(old)
    clock.advance(TTL * 0.95)  # a is stopped (SIGSTOP): it renews nothing
    assert not a.writes()  # it stopped acting before its grant's end in the store
    await _try(b, store)
    assert b.epoch() is None  # the store still counts a's grant
    clock.advance(TTL * 0.1)
    await _try(b, store)
    new = b.taking_over()
    assert new is not None and new > old
    b.took_over(new)
    await _try(a, store)  # a resumes: the store refuses it, it names b
    assert not a.writes() and a.writer() == "b"
    a.took_over(old)  # a late end of its old takeover changes nothing
    assert not a.writes()


async def test_a_front_end_that_does_not_contend_only_learns_the_holder() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a = IndexWriter("docs", "a", clock, TTL)
    b = IndexWriter("docs", "b", clock, TTL, contends=False)
    await _try(b, store)
    assert b.writer() is None and await store.holder(b.lease) is None  # b took nothing
    await _try(a, store)
    a.took_over(a.taking_over() or 0)
    await _try(b, store)
    assert b.writer() == "a"


async def test_the_driver_renews_and_releases_the_lease_when_stopped() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a = IndexWriter("docs", "a", clock, 0.3)
    tries: list[int | None] = []
    three = asyncio.Event()

    def tried() -> None:
        tries.append(a.epoch())
        if len(tries) == 3:
            three.set()

    task = asyncio.create_task(keep_writer_lease(a, store, tried))
    await asyncio.wait_for(three.wait(), 10)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert tries[0] is not None and len(set(tries)) == 1  # renewed under one epoch
    assert await store.holder(a.lease) is None  # released on the way out
    assert a.epoch() is None


async def test_the_lease_is_logged_and_held_under_the_id_the_runtime_gives_the_writer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    writer = IndexWriter("docs", "0", clock, TTL)  # as a runtime builds it, before it knows its front end
    writer.me = "10.0.0.7:8000"
    assert writer.keeper.holder == "10.0.0.7:8000"
    with caplog.at_level("INFO", logger="inferd.cluster"):
        await _try(writer, store)
    assert writer.epoch() is not None
    assert "held by this front end (10.0.0.7:8000)" in caplog.text
    assert "(0)" not in caplog.text
