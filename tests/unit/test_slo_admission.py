"""Admission's deadline check under SLO batching: the lost items (enqueued longer ago than the SLO's
budget) run after the ones that can still meet it, so a new request waits only behind the latter and is
not refused for a backlog it will never wait behind. The fixed policy is FIFO: everything queued counts."""

from __future__ import annotations

import pytest

from inferd.errors import Overloaded
from inferd.kinds.batch.admission import DrainEstimator, check_admission
from inferd.kinds.batch.slo_policy import budget_s, queued_ahead
from inferd.models.sim import sim_config


def measured(max_batch: int = 8, latency_s: float = 0.05) -> DrainEstimator:
    estimator = DrainEstimator(max_batch)
    estimator.observe_batch(max_batch, latency_s)
    return estimator


def test_the_fixed_policy_counts_every_queued_item() -> None:
    assert queued_ahead(sim_config(), lambda since: 0) is None


def test_slo_batching_counts_the_items_within_the_budget_only() -> None:
    config = sim_config(batching="slo", slo={"latency_ms": 200.0})
    asked: list[float] = []
    enqueued = [0.0, 0.1, 0.2, 9.9, 9.95]  # three lost ones at t=10, two that can still make it

    def count_since(since: float) -> int:
        asked.append(since)
        return sum(1 for t in enqueued if t >= since)

    ahead = queued_ahead(config, count_since)
    assert ahead is not None
    assert ahead(10.0) == 2
    assert asked == [pytest.approx(10.0 - budget_s(config.slo))]


def test_a_deadline_is_judged_on_the_items_ahead() -> None:
    estimator = measured()
    # 400 queued items at 8 a batch, 50 ms a batch, one worker: ~2.5 s ahead of a new item.
    with pytest.raises(Overloaded) as refused:
        check_admission("m", 400, 1000, 1, 10.0, 10.5, estimator, 1)
    assert refused.value.reason == "deadline"
    # The same queue, of which 6 items would run before it: 2 batches, 100 ms.
    check_admission("m", 400, 1000, 1, 10.0, 10.5, estimator, 1, ahead=6)
    # The queue's bound still counts every item.
    with pytest.raises(Overloaded) as full:
        check_admission("m", 1000, 1000, 1, 10.0, 10.5, estimator, 1, ahead=6)
    assert full.value.reason == "queue_full"
