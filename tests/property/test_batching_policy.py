"""Batching invariants on a virtual clock (ROADMAP Part 1, RELIABILITY 2.3.3)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.batching.policy import BatchPolicy
from tests.fakes.batch_sim import BatchingSim, SimWorker

TICK = 0.001

events = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive", "arrive", "burst", "cancel", "wait"]),
        st.integers(min_value=0, max_value=40),  # wait in ms / burst size / cancel pick
        st.one_of(st.none(), st.integers(min_value=1, max_value=200)),  # deadline ms
    ),
    min_size=1,
    max_size=120,
)


def scenario(
    max_batch: int, max_wait_ms: int, queue_size: int, n_workers: int, evs
) -> tuple[BatchingSim, int]:
    policy = BatchPolicy(max_batch, max_wait_ms / 1000.0)
    workers = [SimWorker(base_s=0.005 + 0.003 * i, per_item_s=0.0002) for i in range(n_workers)]
    sim = BatchingSim(policy, queue_size, workers, tick_s=TICK)
    rid = 0
    for kind, value, deadline in evs:
        if kind == "arrive":
            sim.arrive(rid, None if deadline is None else deadline / 1000.0)
            rid += 1
        elif kind == "burst":
            for _ in range(value):
                sim.arrive(rid, None if deadline is None else deadline / 1000.0)
                rid += 1
        elif kind == "cancel" and rid:
            sim.cancel(value % rid)
        else:
            sim.advance(value / 1000.0)
    sim.run_until_idle()
    return sim, rid


@settings(max_examples=150, deadline=None)
@given(
    max_batch=st.integers(1, 16),
    max_wait_ms=st.integers(0, 30),
    queue_size=st.integers(16, 64),
    n_workers=st.integers(1, 3),
    evs=events,
)
def test_batching_invariants(max_batch, max_wait_ms, queue_size, n_workers, evs) -> None:
    sim, n = scenario(max_batch, max_wait_ms, queue_size, n_workers, evs)
    out = sim.out
    # every request answered exactly once (result, rejection, cancellation or expiry)
    assert sorted(out.answers) == list(range(n))
    assert all(count == 1 for count in out.answers.values())
    # each result is its own
    for rid, result in out.results.items():
        if isinstance(result, tuple):
            assert result == ("result", rid)
    # no batch over the max, and FIFO across the whole run
    assert all(1 <= len(b) <= max_batch for b in out.batches)
    flat = [rid for b in out.batches for rid in b]
    assert flat == sorted(flat)
    # while a worker was free, nobody waited past max_wait plus one tick for its batch to be cut
    assert all(late <= TICK + 1e-9 for late in out.waits_while_free)
    # the queue never exceeded its bound; cancelled or expired items were never dispatched
    assert out.max_depth <= queue_size
    assert out.dispatched_dead == 0
    cancelled = {rid for rid, r in out.results.items() if r == "cancelled"}
    assert not (cancelled | out.expired) & set(flat)


def test_lone_request_waits_max_wait_for_company() -> None:
    sim = BatchingSim(BatchPolicy(100, 0.010), 1000, [SimWorker(0.020, 0.0001)], tick_s=TICK)
    sim.arrive(0)
    sim.advance(0.009)
    assert sim.out.batches == []
    sim.advance(0.0015)
    assert sim.out.batches == [[0]]


def test_full_batch_dispatches_without_waiting() -> None:
    sim = BatchingSim(BatchPolicy(4, 0.050), 1000, [SimWorker(0.020, 0.0)], tick_s=TICK)
    for rid in range(4):
        sim.arrive(rid)
    assert sim.out.batches == [[0, 1, 2, 3]]


def test_busy_worker_batch_keeps_filling_then_goes_at_once() -> None:
    sim = BatchingSim(BatchPolicy(100, 0.010), 1000, [SimWorker(0.030, 0.0)], tick_s=TICK)
    sim.arrive(0)
    sim.advance(0.011)  # batch [0] cut at max_wait
    for rid in range(1, 21):  # 20 arrive while the device is busy
        sim.arrive(rid)
        sim.advance(0.001)
    assert sim.out.batches == [[0]]  # nothing small is staged while busy
    sim.advance(0.011)  # device frees at ~41 ms; the oldest has waited > max_wait
    assert sim.out.batches[1] == list(range(1, 21))


def test_full_batch_is_staged_on_busy_worker() -> None:
    sim = BatchingSim(BatchPolicy(5, 0.010), 1000, [SimWorker(0.050, 0.0)], tick_s=TICK)
    for rid in range(10):
        sim.arrive(rid)
    assert sim.out.batches == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # second is staged
    sim.arrive(10)
    assert len(sim.out.batches) == 2  # a staged batch already waits; no third


def test_preferred_batch_size_cut_at_once() -> None:
    sim = BatchingSim(BatchPolicy(100, 0.050, (4, 8)), 1000, [SimWorker(0.020, 0.0)], tick_s=TICK)
    for rid in range(4):
        sim.arrive(rid)
    assert sim.out.batches == [[0, 1, 2, 3]]


def test_expired_items_never_take_a_batch_slot() -> None:
    sim = BatchingSim(BatchPolicy(10, 0.005), 1000, [SimWorker(0.100, 0.0)], tick_s=TICK)
    sim.arrive(0)
    sim.advance(0.006)  # [0] running for 100 ms
    sim.arrive(1, deadline_s=0.020)
    sim.arrive(2)
    sim.run_until_idle()
    assert 1 in sim.out.expired
    assert [2] in sim.out.batches and all(1 not in b for b in sim.out.batches)
