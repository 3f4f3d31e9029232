"""Placement (pools/placement.py) on a FakeClock: first loads on the roomiest worker, spreading a hot
model, one load at a time per model, and the backoff after a failed load."""

from __future__ import annotations

from inferd.clock import FakeClock
from inferd.pools.placement import Load, ModelDemand, Placement, WorkerView


def worker(wid: str, used: float, held: dict[tuple[str, int], str] | None = None, budget: float = 1000.0,
           accepts: bool = True, evictable: tuple[tuple[float, float], ...] = ()) -> WorkerView:
    return WorkerView(wid, budget, used, held or {}, accepts, evictable)


def demand(model: str, waiting: int, serving: int = 0, memory: float = 300.0, full: int = 4,
           cycle: float = 0.1) -> ModelDemand:
    return ModelDemand(model, 1, waiting, serving, memory, full, cycle)


def test_first_load_goes_to_the_worker_with_most_free_budget() -> None:
    placement = Placement(FakeClock())
    loads = placement.plan([worker("w0", 600), worker("w1", 100), worker("w2", 400)], [demand("a", 1)])
    assert loads == [Load("a", 1, "w1")]
    assert placement.pending("a", 1) == "w1"


def test_no_load_without_waiting_requests_or_with_a_holder() -> None:
    placement = Placement(FakeClock())
    assert placement.plan([worker("w0", 0)], [demand("a", 0)]) == []
    held = worker("w0", 300, {("a", 1): "ready"})
    assert placement.plan([held, worker("w1", 0)], [demand("a", 1, serving=1)]) == []


def test_a_model_loading_anywhere_is_not_asked_of_another_worker() -> None:
    placement = Placement(FakeClock())
    loading = worker("w0", 300, {("a", 1): "loading"})
    assert placement.plan([loading, worker("w1", 0)], [demand("a", 50)]) == []


def test_an_unloading_copy_does_not_count_as_a_holder() -> None:
    placement = Placement(FakeClock())
    leaving = worker("w0", 300, {("a", 1): "unloading"})
    assert placement.plan([leaving, worker("w1", 500)], [demand("a", 1)]) == [Load("a", 1, "w0")]


def test_one_pass_spreads_its_loads_over_the_workers() -> None:
    placement = Placement(FakeClock())
    workers = [worker("w0", 0), worker("w1", 100)]
    loads = placement.plan(workers, [demand("a", 3), demand("b", 2)])
    assert loads == [Load("a", 1, "w0"), Load("b", 1, "w1")]


def test_loads_asked_in_earlier_passes_take_their_workers_room_until_its_state_shows_them() -> None:
    """Each first request of a burst wakes placement in a pass of its own, before the worker's PoolState
    says what it loads: the loads asked already still take its room, so the burst spreads over the
    workers instead of piling on the first (where the ones past its budget would wait for evictions
    while the other worker sits empty)."""
    placement = Placement(FakeClock())
    empty = [worker("w0", 0, budget=130), worker("w1", 0, budget=130)]
    loads = [placement.plan(empty, [demand(m, 1, memory=60)]) for m in "abc"]
    assert loads == [[Load("a", 1, "w0")], [Load("b", 1, "w1")], [Load("c", 1, "w0")]]
    seen = [worker("w0", 60, {("a", 1): "loading"}, budget=130), worker("w1", 0, budget=130)]
    assert placement.plan(seen, [demand("d", 1, memory=60)]) == [Load("d", 1, "w1")]  # a counted once
    placement.ended("b", 1, "w1", ok=True)
    assert placement.plan(empty, [demand("e", 1, memory=60)]) == [Load("e", 1, "w1")]  # b answered


def test_while_the_pools_own_workers_join_a_load_with_no_room_waits_for_them() -> None:
    """At start (or while one restarts) not every worker of the pool has joined: a load that no joined
    worker has room for now, nor can make room for, is not sent to wait at one of them (where it would
    wait for min_resident_s, or fail) while an empty worker is on its way; it is placed once one has room."""
    placement = Placement(FakeClock())
    full = worker("w0", 1000, {("a", 1): "ready"})
    assert placement.plan([full], [demand("b", 1)], patient=True) == []
    assert placement.pending("b", 1) is None
    assert placement.plan([full, worker("w1", 0)], [demand("b", 1)], patient=True) == [Load("b", 1, "w1")]
    room = worker("w0", 1000, {("a", 1): "ready"}, evictable=((300.0, 9.0),))  # it can make room now
    assert placement.plan([room], [demand("c", 1)], patient=True) == [Load("c", 1, "w0")]
    assert placement.plan([full], [demand("d", 1)]) == [Load("d", 1, "w0")]  # all joined: it waits there


def test_a_worker_at_max_loaded_models_has_no_room_whatever_its_memory() -> None:
    """max_loaded_models caps what a worker holds as its budget does: a worker at the cap with memory free
    would have to evict (or wait) for a load that another worker, under the cap, takes at once."""
    placement = Placement(FakeClock())
    capped = WorkerView("w0", 1000.0, 40.0, {("a", 1): "ready", ("b", 1): "ready"}, slots=0)
    roomy = WorkerView("w1", 1000.0, 600.0, {("c", 1): "ready"}, slots=1)
    assert placement.plan([capped, roomy], [demand("d", 1)]) == [Load("d", 1, "w1")]
    evictable = WorkerView("w0", 1000.0, 40.0, {("a", 1): "ready"}, slots=0, evictable=((20.0, 5.0),))
    full = WorkerView("w1", 1000.0, 1000.0, {("c", 1): "ready"}, slots=1)
    assert placement.plan([evictable, full], [demand("e", 1)]) == [Load("e", 1, "w0")]  # it can make room


def test_a_holder_whose_model_server_has_not_joined_yet_is_not_spread_from() -> None:
    """Between a load's end (its worker lists the model ready) and its model server's Ready here, the
    model has a holder but no worker serving it here: its queue says nothing of what that holder serves,
    so it is not hot (else a burst held through a cold start loads a second copy, evicting another)."""
    clock = FakeClock()
    placement = Placement(clock)
    views = [worker("w0", 300, {("a", 1): "ready"}), worker("w1", 0)]
    for _ in range(3):
        assert placement.plan(views, [demand("a", 9, serving=0, cycle=0.01)]) == []
        clock.advance(0.25)
    assert placement.plan(views, [demand("a", 9, serving=1, cycle=0.01)]) == []  # hot from now on
    clock.advance(0.25)
    assert placement.plan(views, [demand("a", 9, serving=1, cycle=0.01)]) == [Load("a", 1, "w1", spread=True)]


def test_a_pending_load_is_not_asked_again_until_it_ends() -> None:
    clock = FakeClock()
    placement = Placement(clock)
    workers = [worker("w0", 0), worker("w1", 0)]
    assert placement.plan(workers, [demand("a", 1)]) == [Load("a", 1, "w0")]
    clock.advance(1.0)
    assert placement.plan(workers, [demand("a", 5)]) == []
    placement.ended("a", 1, "w0", ok=True)
    assert placement.pending("a", 1) is None


def test_a_pending_load_is_forgotten_when_its_worker_goes() -> None:
    placement = Placement(FakeClock())
    assert placement.plan([worker("w0", 0), worker("w1", 10)], [demand("a", 1)]) == [Load("a", 1, "w0")]
    placement.worker_gone("w0")
    assert placement.plan([worker("w1", 10)], [demand("a", 1)]) == [Load("a", 1, "w1")]


def test_a_second_load_lost_with_its_worker_backs_off() -> None:
    """A load that kills its worker (each time) is not asked again and again: the second loss in a row
    starts the backoff a failed load starts; a success resets the count."""
    clock = FakeClock()
    placement = Placement(clock)
    assert placement.plan([worker("w0", 0)], [demand("a", 1)]) == [Load("a", 1, "w0")]
    assert placement.worker_gone("w0", only_loading=True) == []  # the first: asked again at once
    assert placement.plan([worker("w0", 0)], [demand("a", 1)]) == [Load("a", 1, "w0")]
    assert placement.worker_gone("w0", only_loading=True) == [("a", 1)]
    assert placement.retry_in("a", 1) == 2.0  # two failures in a row
    assert placement.plan([worker("w0", 0)], [demand("a", 1)]) == []
    clock.advance(2.5)
    assert placement.plan([worker("w0", 0)], [demand("a", 1)]) == [Load("a", 1, "w0")]
    placement.ended("a", 1, "w0", ok=True)
    assert placement.plan([worker("w0", 0)], [demand("b", 1)]) == [Load("b", 1, "w0")]
    assert placement.worker_gone("w0", only_loading=True) == []  # b's first; a's count was reset
    for _ in range(3):  # a worker that held a model ready may have been ended by its batch: no blame
        assert placement.plan([worker("w0", 0)], [demand("b", 1)]) == [Load("b", 1, "w0")]
        assert placement.worker_gone("w0") == []
    assert placement.retry_in("b", 1) is None


def test_an_unanswered_load_expires() -> None:
    clock = FakeClock()
    placement = Placement(clock, pending_timeout_s=30.0)
    workers = [worker("w0", 0)]
    assert placement.plan(workers, [demand("a", 1)]) != []
    clock.advance(29.0)
    assert placement.plan(workers, [demand("a", 1)]) == []
    clock.advance(2.0)
    assert placement.plan(workers, [demand("a", 1)]) == [Load("a", 1, "w0")]


def test_a_model_bigger_than_every_budget_is_placed_nowhere() -> None:
    placement = Placement(FakeClock())
    assert placement.plan([worker("w0", 0, budget=200)], [demand("a", 1, memory=300)]) == []


def test_a_draining_worker_gets_no_load() -> None:
    placement = Placement(FakeClock())
    workers = [worker("w0", 0, accepts=False), worker("w1", 900)]
    assert placement.plan(workers, [demand("a", 1, memory=50)]) == [Load("a", 1, "w1")]


def test_a_hot_model_gets_one_more_holder_after_a_cycle() -> None:
    clock = FakeClock()
    placement = Placement(clock)
    workers = [worker("w0", 300, {("a", 1): "ready"}), worker("w1", 200), worker("w2", 0)]
    hot = demand("a", 9, serving=1, full=4, cycle=0.5)  # 9 > 2 full batches of 4 per serving worker
    assert placement.plan(workers, [hot]) == []  # hot from now on: judged after a cycle
    clock.advance(0.4)
    assert placement.plan(workers, [hot]) == []
    clock.advance(0.2)
    assert placement.plan(workers, [hot]) == [Load("a", 1, "w2", spread=True)]


def test_a_queue_within_two_batches_per_server_is_not_hot() -> None:
    clock = FakeClock()
    placement = Placement(clock)
    workers = [worker("w0", 300, {("a", 1): "ready"}), worker("w1", 300, {("a", 1): "ready"}), worker("w2", 0)]
    steady = demand("a", 16, serving=2, full=4, cycle=0.1)  # 2 batches of 4 for each of 2 workers
    for _ in range(5):
        assert placement.plan(workers, [steady]) == []
        clock.advance(1.0)


def test_heat_that_cools_starts_over() -> None:
    clock = FakeClock()
    placement = Placement(clock)
    workers = [worker("w0", 300, {("a", 1): "ready"}), worker("w1", 0)]
    placement.plan(workers, [demand("a", 20, serving=1, cycle=1.0)])
    clock.advance(0.8)
    placement.plan(workers, [demand("a", 2, serving=1, cycle=1.0)])  # cooled
    clock.advance(0.8)
    assert placement.plan(workers, [demand("a", 20, serving=1, cycle=1.0)]) == []


def test_never_more_holders_than_workers() -> None:
    clock = FakeClock()
    placement = Placement(clock)
    workers = [worker("w0", 300, {("a", 1): "ready"}), worker("w1", 300, {("a", 1): "ready"})]
    for _ in range(3):
        assert placement.plan(workers, [demand("a", 500, serving=2, cycle=0.0)]) == []
        clock.advance(1.0)


def test_no_spread_while_a_copy_is_loading() -> None:
    clock = FakeClock()
    placement = Placement(clock)
    workers = [worker("w0", 300, {("a", 1): "ready"}), worker("w1", 300, {("a", 1): "loading"}), worker("w2", 0)]
    for _ in range(3):
        assert placement.plan(workers, [demand("a", 500, serving=1, cycle=0.0)]) == []
        clock.advance(1.0)


def test_a_failed_load_backs_off_doubling_and_a_success_resets_it() -> None:
    clock = FakeClock()
    placement = Placement(clock)
    workers = [worker("w0", 0)]
    assert placement.plan(workers, [demand("a", 1)]) == [Load("a", 1, "w0")]
    placement.ended("a", 1, "w0", ok=False)
    assert placement.retry_in("a", 1) == 1.0
    assert placement.plan(workers, [demand("a", 1)]) == []
    clock.advance(1.01)
    assert placement.retry_in("a", 1) is None
    assert placement.plan(workers, [demand("a", 1)]) == [Load("a", 1, "w0")]
    placement.ended("a", 1, "w0", ok=False)
    assert placement.retry_in("a", 1) == 2.0  # doubled
    clock.advance(2.01)
    assert placement.plan(workers, [demand("a", 1)]) == [Load("a", 1, "w0")]
    placement.ended("a", 1, "w0", ok=True)
    assert placement.retry_in("a", 1) is None
    placement.ended("a", 1, "w0", ok=False)
    assert placement.retry_in("a", 1) == 1.0  # reset by the success


def test_a_failing_load_is_tried_at_most_once_per_backoff() -> None:
    """However often the waker asks (every admission, every timer round), loads follow the backoff."""
    clock = FakeClock()
    placement = Placement(clock)
    workers = [worker("w0", 0)]
    sent = 0
    for _ in range(700):  # 70 s, asked every 0.1 s
        for load in placement.plan(workers, [demand("a", 3)]):
            sent += 1
            placement.ended(load.model, load.version, load.worker_id, ok=False)
        clock.advance(0.1)
    assert 5 <= sent <= 8  # at 0, 1, 3, 7, 15, 31, 63 s


def test_forget_drops_pending_and_backoff() -> None:
    placement = Placement(FakeClock())
    placement.plan([worker("w0", 0)], [demand("a", 1)])
    placement.ended("a", 1, "w0", ok=False)
    placement.forget("a", 1)
    assert placement.retry_in("a", 1) is None
    assert placement.pending("a", 1) is None


def test_with_no_room_free_the_pools_least_recently_used_model_makes_room() -> None:
    """Every worker full: the load goes where the longest idle evictable model is (the pool's LRU),
    not always to the same worker."""
    placement = Placement(FakeClock())
    w0 = worker("w0", 900, budget=900, evictable=((300.0, 2.0), (300.0, 1.0)))
    w1 = worker("w1", 900, budget=900, evictable=((300.0, 9.0),))
    assert placement.plan([w0, w1], [demand("a", 1)]) == [Load("a", 1, "w1")]


def test_room_free_beats_room_made_by_evicting() -> None:
    placement = Placement(FakeClock())
    w0 = worker("w0", 900, budget=900, evictable=((300.0, 60.0),))
    w1 = worker("w1", 550, budget=900)
    assert placement.plan([w0, w1], [demand("a", 1)]) == [Load("a", 1, "w1")]


def test_a_worker_that_can_evict_beats_one_whose_models_are_all_protected() -> None:
    placement = Placement(FakeClock())
    protected = worker("w0", 800, budget=900)  # 100 free, nothing evictable: the load would wait
    evicting = worker("w1", 900, budget=900, evictable=((300.0, 0.5),))
    assert placement.plan([protected, evicting], [demand("a", 1)]) == [Load("a", 1, "w1")]
    placement.forget("a", 1)
    assert placement.plan([protected, worker("w1", 900, budget=900)], [demand("a", 1)]) == [Load("a", 1, "w0")]


def test_a_model_queued_on_a_worker_is_joined_not_loaded_elsewhere() -> None:
    """A load waiting on a worker behind its max_concurrent_loads (asked by another front end: nothing is
    pending here) is a load in progress: no other worker gets a copy. The requests here join it there,
    once (its wait for room then runs to their deadline too); a load under way is waited for as it is."""
    placement = Placement(FakeClock())
    queued = WorkerView("w0", 1000.0, 900.0, {("b", 1): "loading", ("a", 1): "queued"}, queued_mb=300.0)
    assert placement.plan([queued, worker("w1", 0)], [demand("a", 5)]) == [Load("a", 1, "w0")]
    assert placement.pending("a", 1) == "w0"
    assert placement.plan([queued, worker("w1", 0)], [demand("a", 5)]) == []  # asked once
    placement.forget("a", 1)
    assert placement.plan([queued, worker("w1", 0)], [demand("a", 0)]) == []  # nothing waits here
    loading = WorkerView("w0", 1000.0, 900.0, {("a", 1): "loading"})
    assert placement.plan([loading, worker("w1", 0)], [demand("a", 5)]) == []
    assert placement.pending("a", 1) is None
    unqueued = WorkerView("w0", 1000.0, 900.0, {("b", 1): "loading"})  # a worker without PoolState.queued
    assert placement.plan([unqueued, worker("w1", 0)], [demand("a", 5)]) == [Load("a", 1, "w1")]


def test_queued_loads_take_their_workers_room() -> None:
    """The loads queued on a worker start before any asked of it now: their room is not free."""
    placement = Placement(FakeClock())
    busy = WorkerView("w0", 1000.0, 0.0, {("b", 1): "queued", ("c", 1): "queued"}, queued_mb=800.0)
    assert busy.free_mb == 200.0
    assert placement.plan([busy, worker("w1", 500)], [demand("a", 1)]) == [Load("a", 1, "w1")]


def test_a_load_asked_here_and_listed_queued_is_counted_once() -> None:
    """A load this front end asked takes its worker's room until the worker's PoolState lists it; listed
    queued, it is counted there (queued_mb), not twice."""
    placement = Placement(FakeClock())
    assert placement.plan([worker("w0", 0), worker("w1", 350)], [demand("a", 1)]) == [Load("a", 1, "w0")]
    listed = WorkerView("w0", 1000.0, 0.0, {("a", 1): "queued"}, queued_mb=300.0)
    # w0: 700 free (not 400), w1: 650: b goes to w0
    assert placement.plan([listed, worker("w1", 350)], [demand("b", 1)]) == [Load("b", 1, "w0")]


def test_no_spread_while_a_copy_is_queued() -> None:
    clock = FakeClock()
    placement = Placement(clock)
    queued = WorkerView("w1", 1000.0, 300.0, {("a", 1): "queued"}, queued_mb=300.0)
    workers = [worker("w0", 300, {("a", 1): "ready"}), queued, worker("w2", 0)]
    for _ in range(3):
        assert placement.plan(workers, [demand("a", 500, serving=1, cycle=0.0)]) == []
        clock.advance(1.0)


def test_a_front_end_that_does_not_spread_asks_first_loads_only() -> None:
    """With several front ends one spreads (the decider): the others never give a hot model a holder, and
    the heat they saw does not carry over to when they spread."""
    clock = FakeClock()
    placement = Placement(clock)
    workers = [worker("w0", 300, {("a", 1): "ready"}), worker("w1", 0)]
    hot = demand("a", 40, serving=1, cycle=0.1)
    asked = []
    for _ in range(4):
        asked += placement.plan(workers, [hot, demand("b", 1)], spreads=False)
        clock.advance(0.5)
    assert asked == [Load("b", 1, "w1")]  # its first loads are asked all the same
    placement.forget("b", 1)
    assert placement.plan(workers, [hot]) == []  # the decider now: hot from now on
    clock.advance(0.2)
    assert placement.plan(workers, [hot]) == [Load("a", 1, "w1", spread=True)]


def test_the_spreader_counts_what_the_other_front_ends_queue() -> None:
    """Its own queue holds a share of the model's requests: the items the other front ends report queued
    count towards its heat (never towards a first load: theirs to ask)."""
    clock = FakeClock()
    placement = Placement(clock)
    workers = [worker("w0", 300, {("a", 1): "ready"}), worker("w1", 0)]
    share = ModelDemand("a", 1, 4, 1, 300.0, 4, 0.1)  # 4 here: within 2 batches of 4
    for _ in range(3):
        assert placement.plan(workers, [share]) == []
        clock.advance(0.2)
    everywhere = ModelDemand("a", 1, 4, 1, 300.0, 4, 0.1, elsewhere=12)  # 16 in all
    assert placement.plan(workers, [everywhere]) == []
    clock.advance(0.5)  # past a cycle, not past a report: the reports may predate the last holder
    assert placement.plan(workers, [everywhere]) == []
    clock.advance(0.6)
    assert placement.plan(workers, [everywhere]) == [Load("a", 1, "w1", spread=True)]
    elsewhere_only = ModelDemand("b", 1, 0, 0, 300.0, 4, 0.1, elsewhere=50)
    assert placement.plan(workers, [elsewhere_only]) == []


def test_two_front_ends_deciding_at_once_ask_one_load() -> None:
    """Two front ends see the same PoolStates at the same moment. A hot model: only the spreader asks
    (one more holder, not two). A first load: both pick the same worker (ties go to the lowest id), where
    the second LoadModel joins the first."""
    clock = FakeClock()
    decider, other = Placement(clock), Placement(clock)
    workers = [worker("w0", 300, {("a", 1): "ready"}), worker("w1", 0), worker("w2", 0)]
    hot = demand("a", 40, serving=1, cycle=0.1)
    asked: list[Load] = []
    for _ in range(4):
        asked += decider.plan(workers, [hot]) + other.plan(workers, [hot], spreads=False)
        clock.advance(0.2)
    assert asked == [Load("a", 1, "w1", spread=True)]
    first = [demand("b", 1)]
    seen = [worker("w0", 300, {("a", 1): "ready"}), worker("w1", 0), worker("w2", 0)]
    assert Placement(clock).plan(seen, first) == Placement(clock).plan(seen, first, spreads=False) == [
        Load("b", 1, "w1")
    ]
