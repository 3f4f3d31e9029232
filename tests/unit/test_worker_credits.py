"""The worker's credit ledger: its batch slots (1 running + 1 staged) across the front ends it serves."""

from __future__ import annotations

import pytest

from inferd.clock import FakeClock
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState
from inferd.worker.credits import STALE_HOLD_S, CreditLedger, Seat, ToldState
from inferd.worker.fronts import take_batch, tell_credits


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


def test_the_models_of_a_pool_worker_share_one_cap_and_each_front_end_is_told_the_devices_state() -> None:
    """Two model servers' seats on one ledger: never more than CAP batches held or granted across both
    models; a front end of one model is told busy while the other model's batch runs, and what runs."""
    clock = FakeClock()
    ledger = CreditLedger(clock)
    held = {"a": 0, "b": 0}

    def counting(model: str) -> Seat:
        return Seat(ledger, (model, 1), lambda change: held.__setitem__(model, held[model] + change))

    a, b = counting("a"), counting("b")
    a.join(0)
    assert ledger.grant() == {(("a", 1), 0): 2}  # alone on the device: both slots, unasked
    a.received(0, items=3)
    a.received(0, items=1)
    assert held == {"a": 2, "b": 0}
    b.join(0)
    b.report(0, queued=4, oldest_age_s=0.01)
    assert ledger.grant() == {}  # a's two batches hold the device's two slots
    assert ledger.held + ledger.statistics().outstanding == 2
    told = b.state_for(0)
    assert not told.idle and b.running_items == 3 and not b.idle  # a's batch runs: b's front end waits
    clock.advance(0.5)
    assert b.running_for_s() == 0.5
    a.finished()
    assert held == {"a": 1, "b": 0}
    assert ledger.grant() == {(("b", 1), 0): 1}
    b.received(0, items=2)
    assert ledger.grant() == {} and ledger.high_water == 2
    b.close()  # its model server ended with its batch unfinished: the slot comes back
    assert held == {"a": 1, "b": 0} and ledger.held == 1
    a.report(0, queued=1, oldest_age_s=0.0)
    assert ledger.grant() == {(("a", 1), 0): 1}


def test_slots_go_only_to_the_front_ends_told() -> None:
    """A front end left out of what is told (a draining model server's) is granted nothing."""
    ledger = CreditLedger(FakeClock())
    ledger.join("a")
    ledger.join("b")
    ledger.report("a", queued=1, oldest_age_s=0.1)
    ledger.report("b", queued=1, oldest_age_s=0.0)
    assert ledger.grant(eligible={"b"}) == {"b": 1}
    assert ledger.outstanding("a") == 0


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
    assert not ledger.accepts(credits=True) and not ledger.accepts(credits=False)  # whichever came first
    shared = CreditLedger(FakeClock())
    shared.join("a")
    assert shared.accepts(credits=True) and not shared.accepts(credits=False)


def test_of_two_front_ends_granted_on_an_idle_worker_only_the_first_is_told_idle() -> None:
    """Both told "idle" would each send a batch to run, and one would wait a whole batch behind the
    other; the second is told "busy" (it stages only a full batch) until the first has used its slot."""
    ledger = CreditLedger(FakeClock())
    ledger.join("a")
    ledger.join("b")
    ledger.report("a", queued=5, oldest_age_s=0.002)
    ledger.report("b", queued=5, oldest_age_s=0.001)
    tell = ledger.to_tell({"a": None, "b": None})
    assert {f: (granted, state.idle) for f, (granted, state) in tell.items()} == {
        "a": (1, True),
        "b": (1, False),
    }
    told = {f: state for f, (_, state) in tell.items()}
    ledger.received("a", 40)  # a's batch arrives and starts: b, holding its slot, is told the new state
    tell = ledger.to_tell(told)
    assert list(tell) == ["b"] and tell["b"][0] == 0 and not tell["b"][1].idle
    told["b"] = tell["b"][1]
    ledger.finished()  # a's batch is done: the worker is idle and b holds the first slot
    tell = ledger.to_tell(told)
    assert tell["b"] == (0, ledger.state_for("b")) and tell["b"][1].idle
    assert "a" not in tell or not tell["a"][1].idle  # a, granted the freed slot (if it asked), waits


def test_the_running_batch_is_told_with_its_size_and_age_and_the_next_starts_as_it_ends() -> None:
    clock = FakeClock()
    ledger = CreditLedger(clock)
    ledger.join("a")
    assert ledger.running_items == 0 and ledger.running_for_s() == 0.0
    ledger.received("a", 64)  # runs at once
    clock.advance_ms(10)
    ledger.received("a", 30)  # staged behind it
    clock.advance_ms(20)
    assert ledger.running_items == 64 and ledger.running_for_s() == pytest.approx(0.03)
    starts = ledger.starts
    ledger.finished()  # the staged one starts with the slot freed: one Credit says both
    assert ledger.running_items == 30 and ledger.running_for_s() == 0.0 and ledger.starts == starts + 1
    assert ledger.to_tell({"a": None}) == {"a": (1, ledger.state_for("a"))}
    ledger.finished()
    assert ledger.running_items == 0 and ledger.running_for_s() == 0.0 and ledger.idle


def test_a_front_end_times_another_front_ends_running_batch_from_the_credit() -> None:
    """On a shared worker the running batch may be another front end's: the Credit's size and age of it
    set when it started and what it holds (the dispatcher's staging time reads both)."""
    conn = WorkerConnection("w-0.0", "m", 0, "sim", None, credits=0)  # type: ignore[arg-type]
    conn.state = WorkerState.READY
    conn.on_credit(p.Credit(1, False, True, running_items=70, running_for_s=0.05), now=10.0)
    assert conn.credits == 1 and conn.stage_free
    assert conn.running_since == pytest.approx(9.95) and conn.running_items == 70
    conn.on_credit(p.Credit(0, False, True, running_items=0), now=10.2)  # told "busy" with nothing held:
    assert conn.running_since == 10.2 and conn.running_items == 0  # another's batch starts about now
    conn.on_credit(p.Credit(0, True, True), now=10.3)  # a worker that does not say: its idle flag only
    assert conn.running_since == 10.2 and conn.idle


def test_a_first_holder_that_does_not_use_its_slot_stops_keeping_the_others_busy() -> None:
    """Its front end ejected the worker, or stalled: after STALE_HOLD_S the next holder is told idle too
    (the worker re-tells its front ends at each heartbeat)."""
    clock = FakeClock()
    ledger = CreditLedger(clock)
    for front in ("a", "b"):
        ledger.join(front)
        ledger.report(front, queued=5, oldest_age_s=0.0)
        clock.advance_ms(1)
    told = {f: state for f, (_, state) in ledger.to_tell({"a": None, "b": None}).items()}
    assert told["a"].idle and not told["b"].idle
    clock.advance(STALE_HOLD_S / 2)
    assert ledger.to_tell(told) == {}  # nothing changed yet
    clock.advance(STALE_HOLD_S)
    tell = ledger.to_tell(told)
    assert list(tell) == ["b"] and tell["b"][1].idle  # a still holds its slot, unused: b may send


class RecordingLink:
    """A FrontLink's surface that tell_credits and take_batch use: what it is sent, what it was told."""

    def __init__(self, index: str) -> None:
        self.index = index
        self.credits = True
        self.told: ToldState | None = None
        self.sent: list[p.Credit] = []

    def send(self, msg: p.Credit) -> None:
        self.sent.append(msg)


def test_a_lone_front_end_is_not_told_that_its_own_batch_started_but_sharing_ones_are() -> None:
    """A front end served alone knows its own batch runs (it sent it): no Credit says so, one write and
    one read fewer per batch; the Credit that frees the slot when it ends says what changed. Front ends
    sharing the worker are told at once (another's slot now waits behind it)."""
    ledger = CreditLedger(FakeClock())
    ledger.join("a")
    a = RecordingLink("a")
    links = {"a": a}
    tell_credits(ledger, links)  # type: ignore[arg-type]
    assert [c.granted for c in a.sent] == [2]
    take_batch(ledger, a, 40)  # type: ignore[arg-type]
    tell_credits(ledger, links)  # type: ignore[arg-type]
    assert len(a.sent) == 1 and a.told == ledger.state_for("a")
    ledger.finished()
    tell_credits(ledger, links)  # type: ignore[arg-type]
    assert len(a.sent) == 2 and (a.sent[1].granted, a.sent[1].idle, a.sent[1].running_items) == (1, True, 0)

    shared = CreditLedger(FakeClock())
    b, c = RecordingLink("b"), RecordingLink("c")
    both = {"b": b, "c": c}
    for front in both:
        shared.join(front)
        shared.report(front, queued=5, oldest_age_s=0.001)
    tell_credits(shared, both)  # type: ignore[arg-type]
    assert [m.granted for m in b.sent + c.sent] == [1, 1]
    take_batch(shared, b, 40)  # type: ignore[arg-type]
    tell_credits(shared, both)  # type: ignore[arg-type]
    assert len(b.sent) == 1 and len(c.sent) == 2 and not c.sent[1].idle and c.sent[1].running_items == 40
