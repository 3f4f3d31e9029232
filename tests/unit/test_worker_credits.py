"""The worker's credit ledger: its batch slots (1 running + 1 staged) across the front ends it serves."""

from __future__ import annotations

import pytest

from inferd.clock import FakeClock
from inferd.worker.credits import CreditLedger


def test_a_lone_front_end_is_granted_both_slots_unasked() -> None:
    ledger = CreditLedger(FakeClock())
    ledger.join("a")
    assert ledger.grant() == {"a": 2}
    ledger.received("a")
    ledger.received("a")
    assert ledger.grant() == {}
    ledger.finished()
    assert ledger.grant() == {"a": 1}
    assert ledger.high_water == 2


def test_shared_slots_go_on_demand_oldest_first_and_never_exceed_the_cap() -> None:
    clock = FakeClock()
    ledger = CreditLedger(clock)
    ledger.join("a")
    ledger.join("b")
    assert ledger.grant() == {}  # nobody asked
    ledger.report("a", queued=9, oldest_age_s=0.001)
    ledger.report("b", queued=1, oldest_age_s=0.004)
    assert ledger.grant() == {"b": 1, "a": 1}  # both free slots, one each
    ledger.received("b")
    ledger.report("b", queued=3, oldest_age_s=0.0)
    assert ledger.grant() == {}  # a holds the other slot
    ledger.received("a")
    ledger.report("a", queued=2, oldest_age_s=0.0)
    clock.advance_ms(2)  # both oldest items now 2 ms old: the fuller queue breaks the tie
    ledger.finished()
    assert ledger.grant() == {"b": 1}
    assert ledger.held + ledger.statistics().outstanding == 2
    assert ledger.high_water == 2


def test_the_oldest_waiting_item_wins_the_free_slot() -> None:
    clock = FakeClock()
    ledger = CreditLedger(clock, cap=1)
    ledger.join("a")
    ledger.join("b")
    ledger.report("a", queued=50, oldest_age_s=0.002)
    clock.advance_ms(1)
    ledger.report("b", queued=1, oldest_age_s=0.0025)  # a's item is now 3 ms old
    assert ledger.grant() == {"a": 1}


def test_slots_given_back_or_left_behind_return_to_the_pool() -> None:
    ledger = CreditLedger(FakeClock())
    ledger.join("a")
    assert ledger.grant() == {"a": 2}
    ledger.join("b")  # shared now: a gives back what it cannot use
    ledger.report("a", queued=0, oldest_age_s=0.0, returned=2)
    ledger.report("b", queued=4, oldest_age_s=0.0)
    assert ledger.grant() == {"b": 1}
    ledger.leave("b")
    assert ledger.grant() == {"a": 2}


def test_a_front_end_without_credits_is_only_served_alone() -> None:
    ledger = CreditLedger(FakeClock())
    assert ledger.accepts_legacy()
    ledger.join("old", legacy=True)
    assert ledger.grant() == {}
    assert not ledger.accepts_legacy()
    with pytest.raises(ValueError, match="alone"):
        ledger.join("new", legacy=True)
