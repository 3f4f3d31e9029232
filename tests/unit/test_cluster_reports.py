"""cluster/reports.py: each front end's report of one kind, read by the others (on MemoryStore and a fake
clock for the ttl)."""

from __future__ import annotations

import msgspec

from inferd.clock import FakeClock
from inferd.cluster.memory import MemoryStore
from inferd.cluster.reports import Reports


class Said(msgspec.Struct, frozen=True):
    generation: int = 0


async def test_others_reports_leave_out_ones_own_the_expired_and_the_undecodable() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a, b, c = (Reports(store, "said/", Said, me, ttl_s=2.0) for me in ("a", "b", "c"))
    await a.publish(Said(1))
    revision = await b.publish(Said(2))
    await store.write("said/d", b"\xc1", ttl_s=2.0)  # not msgpack of Said: left out, not an error
    assert await a.others() == {"b": (revision, Said(2))}
    assert set(await c.others()) == {"a", "b"}
    clock.advance(1.5)
    await b.publish(Said(3))  # written again: its ttl starts again
    clock.advance(1.0)  # a's expired (2.5 s after it was written), b's has not
    assert {f: r for f, (_, r) in (await c.others()).items()} == {"b": Said(3)}


async def test_until_answers_who_still_lags_after_the_wait_and_nobody_once_they_caught_up() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    me, other = Reports(store, "said/", Said, "me", 2.0), Reports(store, "said/", Said, "other", 2.0)
    await me.publish(Said(0))  # one's own report never makes one wait
    assert await me.until(lambda r: r.generation < 5, 0.05) == {}  # nobody else heard of
    await other.publish(Said(4))
    assert await me.until(lambda r: r.generation < 5, 0.05) == {"other": Said(4)}
    await other.publish(Said(5))
    assert await me.until(lambda r: r.generation < 5, 0.05) == {}
    await other.publish(Said(4))
    clock.advance(3.0)  # it went silent: its report expired, nobody waits for it
    assert await me.until(lambda r: r.generation < 5, 0.05) == {}
