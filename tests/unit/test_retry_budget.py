"""The retry budget: a share of recent requests plus a floor, forgetting what left its window."""

from __future__ import annotations

import pytest

from inferd.clock import FakeClock
from inferd.routing.retry import RetryBudget


def test_budget_is_ratio_of_recent_requests_plus_floor() -> None:
    clock = FakeClock()
    budget = RetryBudget(clock, ratio=0.2, min_per_s=1.0, window_s=10.0)
    budget.record_requests(100)
    assert budget.balance() == pytest.approx(10 + 20)
    assert all(budget.try_spend() for _ in range(30))
    assert not budget.try_spend()
    assert budget.statistics().exhausted_total == 1


def test_old_requests_and_retries_leave_the_window_without_any_retry() -> None:
    """Memory and counts stay bounded at any rate, even when nothing is ever retried."""
    clock = FakeClock()
    budget = RetryBudget(clock, ratio=0.2, min_per_s=0.0, window_s=10.0)
    for _ in range(100_000):  # 1,000 requests/s for 100 s
        budget.record_requests(1)
        clock.advance(0.001)
    stats = budget.statistics()
    assert 10_000 <= stats.requests_in_window <= 11_000
    budget.try_spend(5)
    clock.advance(12.0)
    assert budget.statistics().retries_in_window == 0 and budget.statistics().requests_in_window == 0
