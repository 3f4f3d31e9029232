"""pools/residency.py on a fake clock: what a pool worker loads, evicts, waits for and refuses."""

from __future__ import annotations

from inferd.clock import FakeClock
from inferd.pools.residency import (
    LOADING,
    READY,
    UNLOADING,
    Evict,
    FailLoad,
    Joined,
    Limits,
    Queued,
    Residency,
    StartLoad,
)

A, B, C, D = ("a", 1), ("b", 1), ("c", 1), ("d", 1)


def residency(budget_mb: float = 100.0, **limits: object) -> tuple[Residency, FakeClock]:
    clock = FakeClock()
    return Residency(Limits(budget_mb=budget_mb, **limits), clock), clock  # type: ignore[arg-type]


def load(r: Residency, key: tuple[str, int], size_mb: float, measured_mb: float | None = None) -> None:
    """Ask for a load, see it start, and end it (measured at its size unless said)."""
    assert r.ask(key, size_mb, 0.0) == Queued(key)
    assert r.step() == [StartLoad(key, size_mb)]
    assert r.loaded(key, size_mb if measured_mb is None else measured_mb)


def test_a_load_that_fits_starts_at_once_and_a_second_ask_joins_it() -> None:
    r, _ = residency()
    assert r.ask(A, 40.0, 0.0) == Queued(A)
    assert r.ask(A, 40.0, 0.0) == Joined(A, ready=False)
    assert r.step() == [StartLoad(A, 40.0)]
    assert r.held[A].state == LOADING and r.used_mb() == 40.0
    assert r.ask(A, 40.0, 0.0) == Joined(A, ready=False)
    assert r.loaded(A, 35.0)
    assert r.ask(A, 40.0, 0.0) == Joined(A, ready=True)
    assert r.held[A].state == READY and r.used_mb() == 35.0


def test_a_model_bigger_than_the_whole_budget_fails_at_once_naming_both_sizes() -> None:
    r, _ = residency(budget_mb=100.0)
    failed = r.ask(A, 150.0, 30.0)
    assert isinstance(failed, FailLoad)
    assert "150 MB" in failed.reason and "100 MB" in failed.reason
    assert r.step() == [] and not r.pending


def test_loads_past_max_waiting_loads_fail_at_once_naming_the_bound() -> None:
    r, _ = residency(budget_mb=100.0, max_loaded_models=1, max_waiting_loads=2)
    load(r, A, 10.0)
    assert r.ask(B, 10.0, 30.0) == Queued(B)
    assert r.ask(C, 10.0, 30.0) == Queued(C)
    failed = r.ask(D, 10.0, 30.0)
    assert isinstance(failed, FailLoad) and failed.key == D
    assert "2 loads waiting" in failed.reason and "at most 2" in failed.reason
    assert [load.key for load in r.pending] == [B, C] and not r.knows(D)
    assert r.ask(C, 10.0, 30.0) == Joined(C, ready=False)  # one waiting already: joined, not refused


def test_the_measured_size_replaces_the_estimate() -> None:
    r, _ = residency(budget_mb=100.0)
    load(r, A, 10.0, measured_mb=120.0)  # the estimate fit; what it took did not
    assert r.size_mb(A, 10.0) == 120.0
    evicted = r.step()
    assert evicted == []  # over budget, but a is protected (min_resident_s) and the only model
    r.unload(A)
    r.unloaded(A)
    failed = r.ask(A, 10.0, 0.0)  # next time it is planned at what it measured: bigger than the budget
    assert isinstance(failed, FailLoad) and "120 MB" in failed.reason


def test_the_least_recently_used_evictable_model_is_evicted_and_the_load_starts_once_it_is_unloaded() -> None:
    r, clock = residency(budget_mb=100.0, min_resident_s=5.0)
    load(r, A, 40.0)
    load(r, B, 40.0)
    clock.advance(10.0)
    r.busy(A)
    r.idle(A)  # a was used after b: b is the least recently used
    assert r.ask(C, 40.0, 0.0) == Queued(C)
    assert r.step() == [Evict(B)]
    assert r.held[B].state == UNLOADING
    assert r.step() == []  # b still holds its memory while it drains
    r.unloaded(B)
    assert r.step() == [StartLoad(C, 40.0)]
    assert set(r.held) == {A, C}


def test_a_busy_model_is_not_evicted() -> None:
    r, clock = residency(budget_mb=100.0, min_resident_s=1.0)
    load(r, A, 60.0)
    clock.advance(2.0)
    r.busy(A)
    assert r.ask(B, 60.0, 10.0) == Queued(B)
    assert r.step() == []
    r.idle(A)
    assert r.step() == [Evict(A)]


def test_a_load_waits_for_a_protected_model_to_age_then_evicts_it() -> None:
    r, clock = residency(budget_mb=100.0, min_resident_s=5.0)
    load(r, A, 60.0)
    clock.advance(2.0)
    assert r.ask(B, 60.0, 10.0) == Queued(B)
    assert r.step() == []  # a is protected for 3 s more: nothing evicted, the load waits
    assert r.next_at() == clock.now() + 3.0
    clock.advance(3.0)
    assert r.step() == [Evict(A)]


def test_a_load_that_cannot_get_room_within_its_wait_fails_naming_the_sizes() -> None:
    r, clock = residency(budget_mb=100.0, min_resident_s=60.0)
    load(r, A, 60.0)
    assert r.ask(B, 50.0, 2.0) == Queued(B)
    assert r.step() == []
    assert r.next_at() == clock.now() + 2.0  # its deadline comes before a ages
    clock.advance(2.0)
    [failed] = r.step()
    assert isinstance(failed, FailLoad) and failed.key == B
    assert "50 MB" in failed.reason and "60 of 100 MB" in failed.reason and "min_resident_s" in failed.reason
    assert not r.pending and set(r.held) == {A}


def test_nothing_is_evicted_when_evicting_every_evictable_model_would_not_make_room() -> None:
    r, clock = residency(budget_mb=100.0, min_resident_s=5.0)
    load(r, A, 30.0)
    clock.advance(10.0)
    load(r, B, 50.0)  # protected
    assert r.ask(C, 60.0, 10.0) == Queued(C)
    assert r.step() == []  # evicting a alone frees 30 MB of the 40 short: a keeps serving
    clock.advance(4.0)
    assert r.step() == []
    clock.advance(1.0)  # b may go too now: both, least recently used first
    assert r.step() == [Evict(A), Evict(B)]


def test_max_loaded_models_caps_the_count_as_the_budget_caps_memory() -> None:
    r, clock = residency(budget_mb=1000.0, max_loaded_models=2, min_resident_s=0.0)
    load(r, A, 1.0)
    clock.advance(1.0)
    load(r, B, 1.0)
    assert r.ask(C, 1.0, 0.0) == Queued(C)
    assert r.step() == [Evict(A)]
    r.unloaded(A)
    assert r.step() == [StartLoad(C, 1.0)]


def test_max_concurrent_loads_queues_the_loads_past_it_in_order() -> None:
    r, _ = residency(budget_mb=1000.0, max_concurrent_loads=2)
    for key in (A, B, C, D):
        assert r.ask(key, 10.0, 0.0) == Queued(key)
    assert r.step() == [StartLoad(A, 10.0), StartLoad(B, 10.0)]
    assert [load.key for load in r.pending] == [C, D]
    assert r.loaded(B, 10.0)
    assert r.step() == [StartLoad(C, 10.0)]
    r.load_failed(A)
    assert r.step() == [StartLoad(D, 10.0)]
    assert not r.pending


def test_an_unload_asked_during_a_load_unloads_it_once_loaded_and_one_not_started_fails() -> None:
    r, _ = residency(budget_mb=1000.0)
    assert r.ask(A, 10.0, 0.0) == Queued(A)
    assert r.ask(B, 10.0, 0.0) == Queued(B)
    assert r.step() == [StartLoad(A, 10.0)]
    assert r.unload(A) is None  # loading: unloaded once loaded
    failed = r.unload(B)
    assert isinstance(failed, FailLoad) and failed.key == B
    assert not r.loaded(A, 10.0)
    assert r.held[A].state == UNLOADING
    assert r.unload(A) is None  # unloading already


def test_a_load_asked_while_the_model_unloads_starts_once_it_is_unloaded() -> None:
    r, _ = residency(budget_mb=1000.0)
    load(r, A, 10.0)
    assert r.unload(A) is True
    assert r.ask(A, 10.0, 0.0) == Queued(A)
    assert r.step() == []
    r.unloaded(A)
    assert r.step() == [StartLoad(A, 10.0)]


def test_a_measurement_above_the_estimate_evicts_back_within_the_budget() -> None:
    r, clock = residency(budget_mb=100.0, min_resident_s=1.0)
    load(r, A, 40.0)
    clock.advance(2.0)
    load(r, B, 40.0, measured_mb=80.0)  # 120 MB held now
    assert r.step() == [Evict(A)]


def test_nothing_to_wait_for_means_no_wake_up() -> None:
    r, _ = residency()
    assert r.next_at() is None
    load(r, A, 10.0)
    assert r.next_at() is None


def test_a_load_queued_behind_the_loads_under_way_asks_for_no_wake_up_once_its_wait_is_over() -> None:
    """Its deadline is for room, not for a load slot: once past, only an event (a load ending) matters,
    and a driver must not be woken again and again."""
    r, clock = residency(budget_mb=1000.0, max_concurrent_loads=1)
    assert r.ask(A, 10.0, 0.0) == Queued(A)
    assert r.step() == [StartLoad(A, 10.0)]
    assert r.ask(B, 10.0, 1.0) == Queued(B)
    assert r.next_at() == clock.now() + 1.0
    clock.advance(2.0)
    assert r.step() == [] and r.next_at() is None
    assert r.loaded(A, 10.0)
    assert r.step() == [StartLoad(B, 10.0)]  # it fits: it starts, however long it waited for the slot


def test_a_model_protected_until_a_time_is_evictable_at_that_time_and_woken_for_then() -> None:
    """`since + min_resident_s <= now` and `now - since >= min_resident_s` can disagree in floating point
    (here since = 1000.0, min_resident_s = 0.3): the wake-up and the rule must use the same one, or the
    wake for it is skipped and the load waits for its deadline."""
    clock = FakeClock(start=1000.0)
    r = Residency(Limits(budget_mb=100.0, max_loaded_models=1, min_resident_s=0.3), clock)
    load(r, A, 1.0)
    assert r.ask(B, 1.0, 10.0) == Queued(B)
    assert r.step() == []
    wake = r.next_at()
    assert wake is not None and wake < 1010.0
    clock.advance(wake - clock.now())
    assert clock.now() == 1000.0 + 0.3 and clock.now() - 1000.0 < 0.3  # where the two forms disagree
    assert r.step() == [Evict(A)]



def use(r: Residency, key: tuple[str, int]) -> None:
    """One batch of the model, run now."""
    r.busy(key)
    r.idle(key)


def test_a_hot_model_is_not_evicted_because_the_models_loaded_after_it_are_protected() -> None:
    """LRU order is kept: a is used again and again, b was loaded for one request. b, protected for a
    while, is the least recently used: the load of c waits for b to age and then evicts b, never a
    (which evicting whatever is evictable at once would)."""
    r, clock = residency(budget_mb=100.0, max_loaded_models=2, min_resident_s=5.0)
    load(r, A, 10.0)
    clock.advance(10.0)
    load(r, B, 10.0)  # loaded (and used) now: protected until 5 s from now
    protected_until = clock.now() + 5.0
    clock.advance(1.0)
    use(r, A)  # used after b; loaded 11 s ago: evictable
    assert r.ask(C, 10.0, 30.0) == Queued(C)
    assert r.step() == []  # b is the least recently used, and protected: the load waits for it
    assert r.next_at() == protected_until
    clock.advance(4.0)
    use(r, A)
    assert r.step() == [Evict(B)]


def test_a_models_size_is_the_largest_measured_of_its_loads() -> None:
    """A reload into memory the allocator kept from the last unload measures little: the size planned
    stays what the model was measured at before."""
    r, _ = residency(budget_mb=100.0)
    load(r, A, 40.0, measured_mb=35.0)
    assert r.size_mb(A, 40.0) == 35.0
    assert r.unload(A) is True
    r.unloaded(A)
    assert r.ask(A, 40.0, 0.0) == Queued(A)
    assert r.step() == [StartLoad(A, 35.0)]
    assert r.loaded(A, 1.0)
    assert r.size_mb(A, 40.0) == 35.0 and r.used_mb() == 35.0
