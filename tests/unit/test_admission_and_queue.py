"""The bounded queue and admission: bounds, withdrawal, expiry, Retry-After from measured drain."""

from __future__ import annotations

import pytest

from inferd.errors import Overloaded, retry_after_s
from inferd.kinds.batch.admission import DrainEstimator, check_admission
from inferd.kinds.batch.queue import ItemState, QueuedItem, RequestQueue


def test_queue_is_fifo_bounded_and_skips_withdrawn() -> None:
    q = RequestQueue(3)
    items = [QueuedItem(i, 0.0, None) for i in range(3)]
    for item in items:
        q.push(item)
    with pytest.raises(OverflowError):
        q.push(QueuedItem(9, 0.0, None))
    assert q.withdraw(items[0]) and not q.withdraw(items[0])
    assert len(q) == 2 and q.oldest_at() == 0.0
    batch, expired = q.cut(10, now=1.0)
    assert [i.payload for i in batch] == [1, 2] and expired == []
    assert all(i.state is ItemState.RUNNING for i in batch)


def test_cut_takes_expired_items_out_without_using_slots() -> None:
    q = RequestQueue(10)
    q.push(QueuedItem("late", 0.0, deadline=0.5))
    q.push(QueuedItem("a", 0.0, None))
    q.push(QueuedItem("b", 0.0, None))
    batch, expired = q.cut(2, now=1.0)
    assert [i.payload for i in batch] == ["a", "b"]
    assert [i.payload for i in expired] == ["late"] and expired[0].state is ItemState.EXPIRED
    assert len(q) == 0


def test_withdraw_compacts_so_physical_size_stays_bounded() -> None:
    q = RequestQueue(4)
    for n in range(1000):
        item = QueuedItem(n, 0.0, None)
        q.push(item)
        q.withdraw(item)
    assert len(q) == 0
    assert q.statistics().physical <= 2 * 4 + 64


def test_push_front_restores_original_order() -> None:
    q = RequestQueue(10)
    for n in range(4):
        q.push(QueuedItem(n, 0.0, None))
    batch, _ = q.cut(2, now=0.0)
    q.push_front(batch)
    assert [i.payload for i in q.cut(10, now=0.0)[0]] == [0, 1, 2, 3]


def test_full_queue_rejects_with_retry_after_from_measured_drain() -> None:
    est = DrainEstimator(max_batch_size=100)
    for _ in range(5):
        est.observe_batch(100, 0.030)
    with pytest.raises(Overloaded) as info:
        check_admission("sim", 1000, 1000, 1, now=0.0, deadline=None, estimator=est, workers=1)
    # 1000 queued = 10-11 batches of 30 ms on one worker: about 0.33 s to drain
    assert info.value.reason == "queue_full"
    assert 0.3 <= info.value.retry_after_s <= 0.4
    assert retry_after_s(info.value.retry_after_s) == 1
    assert "queue is full (1000/1000" in info.value.message


def test_deadline_that_cannot_be_met_is_refused_with_the_numbers() -> None:
    est = DrainEstimator(max_batch_size=10)
    est.observe_batch(10, 0.100)
    with pytest.raises(Overloaded, match=r"predicted wait 600 ms exceeds the remaining deadline of 200 ms"):
        check_admission("sim", 49, 1000, 1, now=0.0, deadline=0.2, estimator=est, workers=1)
    check_admission("sim", 49, 1000, 1, now=0.0, deadline=0.7, estimator=est, workers=1)


def test_no_refusal_on_deadline_before_anything_was_measured() -> None:
    est = DrainEstimator(max_batch_size=10)
    check_admission("sim", 5, 100, 1, now=0.0, deadline=0.001, estimator=est, workers=1)


def test_full_batch_latency_is_extrapolated_from_small_batches() -> None:
    """At low load only small batches are seen; a line through them predicts the full batch's cost
    (sim: 100 ms + 1 ms per item -> 200 ms at 100), where the plain EWMA would say ~110 ms."""
    est = DrainEstimator(max_batch_size=100)
    assert est.full_batch_latency_s() is None
    for size in (3, 5, 9, 12, 17, 20):
        est.observe_batch(size, 0.100 + 0.001 * size)
    assert est.full_batch_latency_s() == pytest.approx(0.200, rel=0.02)
    assert est.batch_latency_s is not None and est.batch_latency_s < 0.13
