"""RequestQueue.cut with `since` (SLO batching): the items that can still meet the SLO first, oldest first,
then the oldest others; an item taken from the middle of its lane and put back is never held twice."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.kinds.batch.queue import ItemState, QueuedItem, RequestQueue
from inferd.routing.fairness import BULK, TenantShare


def queue_of(times: list[float], size: int = 100) -> tuple[RequestQueue, list[QueuedItem]]:
    q = RequestQueue(size)
    items = [QueuedItem(n, t, None) for n, t in enumerate(times)]
    for item in items:
        q.push(item)
    return q, items


def test_since_takes_the_newer_items_oldest_first_and_leaves_the_older_queued() -> None:
    q, _ = queue_of([0.0, 0.1, 0.2, 0.5, 0.6, 0.7])
    assert q.times_since(0.5) == [0.5, 0.6, 0.7]
    batch, expired = q.cut(2, now=1.0, since=0.5)
    assert [i.payload for i in batch] == [3, 4] and expired == []
    assert len(q) == 4 and q.oldest_at() == 0.0
    rest, _ = q.cut(10, now=1.0)
    assert [i.payload for i in rest] == [0, 1, 2, 5]


def test_since_fills_the_room_left_with_the_oldest_others() -> None:
    q, _ = queue_of([0.0, 0.1, 0.2, 0.5, 0.6])
    batch, _ = q.cut(4, now=1.0, since=0.5)
    assert [i.payload for i in batch] == [3, 4, 0, 1]
    assert [i.payload for i in q.live_items()] == [2]


def test_since_takes_expired_items_out_without_using_slots() -> None:
    q = RequestQueue(10)
    q.push(QueuedItem("old", 0.0, None))
    q.push(QueuedItem("gone", 0.5, deadline=0.8))
    q.push(QueuedItem("a", 0.6, None))
    batch, expired = q.cut(1, now=1.0, since=0.5)
    assert [i.payload for i in batch] == ["a"]
    assert [i.payload for i in expired] == ["gone"] and expired[0].state is ItemState.EXPIRED
    assert [i.payload for i in q.live_items()] == ["old"]


def test_an_item_taken_from_the_middle_and_put_back_is_queued_once() -> None:
    q, _ = queue_of([0.0, 0.1, 0.5, 0.6, 0.7])
    batch, _ = q.cut(2, now=1.0, since=0.5)
    q.push_front(batch)  # its worker was lost: the batch goes back to the head
    assert len(q) == 5 and q.statistics().physical == 5
    everything, _ = q.cut(10, now=1.0)
    assert sorted(i.payload for i in everything) == [0, 1, 2, 3, 4]
    assert len(q) == 0 and q.cut(10, now=1.0) == ([], [])


def test_since_serves_tenants_in_fair_order_among_the_newer_items() -> None:
    q = RequestQueue(100)
    a, b = TenantShare("a"), TenantShare("b")
    for n in range(6):
        q.push(QueuedItem(("a", n), 0.1 * n, None, tenant=a))
    for n in range(3):
        q.push(QueuedItem(("b", n), 0.3 + 0.1 * n, None, tenant=b))
    batch, _ = q.cut(4, now=1.0, since=0.3)
    taken = [i.payload for i in batch]
    assert sorted(taken) == [("a", 3), ("a", 4), ("b", 0), ("b", 1)]
    assert all(i.enqueued_at >= 0.3 for i in batch)


ops = st.lists(
    st.tuples(
        st.sampled_from(["push", "push", "push", "cut", "cut_since", "put_back", "withdraw"]),
        st.integers(0, 30),
        st.floats(0.0, 1.0),
    ),
    max_size=150,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, tenants=st.integers(1, 3))
def test_every_item_is_queued_taken_or_withdrawn_exactly_once(ops, tenants) -> None:
    q = RequestQueue(40)
    shares = [TenantShare(f"t{k}") for k in range(tenants)]
    queued: dict[int, QueuedItem] = {}
    out: list[list[QueuedItem]] = []
    next_id = 0
    for kind, n, frac in ops:
        now = next_id * 0.01
        if kind == "push" and q.free() > 0:
            item = QueuedItem(next_id, now, None, tenant=shares[n % tenants])
            q.push(item)
            queued[next_id] = item
            next_id += 1
        elif kind in ("cut", "cut_since"):
            since = None if kind == "cut" else now * frac
            batch, expired = q.cut(n, now, since)
            assert not expired and len(batch) <= n
            for item in batch:
                assert queued.pop(item.payload) is item, "an item was taken twice"
            out.append(batch)
        elif kind == "put_back" and out:
            batch = out.pop(n % len(out))
            q.push_front(batch)
            queued.update((i.payload, i) for i in batch)
        elif kind == "withdraw" and queued:
            item = list(queued.values())[n % len(queued)]
            assert q.withdraw(item)
            del queued[item.payload]
        live = q.live_items()
        assert len(live) == len(q) == len(queued)
        assert {i.payload for i in live} == set(queued)
        assert q.statistics().physical <= 2 * 40 + 64 + len(queued)


def test_lost_interactive_items_go_before_newer_bulk_items() -> None:
    q = RequestQueue(20)
    for n in range(3):
        q.push(QueuedItem(f"lost-{n}", 0.1 * n, None))  # interactive, enqueued before `since`
    for n in range(3):
        q.push(QueuedItem(f"bulk-{n}", 1.0 + 0.1 * n, None, priority=BULK))  # newer, bulk
    assert q.count_since(0.5) == 3
    batch, _ = q.cut(4, now=2.0, since=0.5)
    assert [i.payload for i in batch] == ["lost-0", "lost-1", "lost-2", "bulk-0"]


def test_count_since_counts_the_live_items_from_since_on() -> None:
    q, items = queue_of([0.0, 0.1, 0.5, 0.6, 0.7])
    assert q.count_since(0.5) == len(q.times_since(0.5)) == 3
    q.withdraw(items[3])
    assert q.count_since(0.5) == 2
    assert q.count_since(0.0) == 4
