"""Priority classes: interactive work never leaves after bulk work that arrived later; bulk is shed first."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.api.http import parse_priority
from inferd.clock import FakeClock
from inferd.errors import BadRequest, Overloaded
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.kinds.batch.queue import QueuedItem, RequestQueue
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.fairness import BULK, INTERACTIVE
from inferd.routing.retry import RetryBudget
from inferd.wire.connection import WorkerConnection
from tests.fakes.worker import FakeWriter

ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from([INTERACTIVE, BULK])),
        st.tuples(st.just("cut"), st.integers(1, 8)),
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_interactive_never_dispatched_after_later_bulk(ops) -> None:
    q = RequestQueue(64)
    arrival = 0
    dispatched: list[tuple[int, int, int]] = []  # (batch index, arrival, priority)
    for n, (kind, arg) in enumerate(ops):
        if kind == "push" and q.free() > 0:
            q.push(QueuedItem(arrival, float(arrival), None, priority=arg))
            arrival += 1
        elif kind == "cut":
            batch, _ = q.cut(arg, now=0.0)
            dispatched += [(n, i.payload, i.priority) for i in batch]
    position = {a: (n, k) for k, (n, a, _) in enumerate(dispatched)}
    for _, a_i, p_i in dispatched:
        if p_i != INTERACTIVE:
            continue
        for _, a_b, p_b in dispatched:
            if p_b == BULK and a_b > a_i:
                assert position[a_i] < position[a_b], "interactive left after later bulk work"
    for cls in (INTERACTIVE, BULK):  # FIFO within a class
        order = [a for _, a, p in dispatched if p == cls]
        assert order == sorted(order)


def make_runtime() -> ModelRuntime:
    clock = FakeClock()
    rt = ModelRuntime(
        sim_config(max_batch_size=10, max_queue_size=40),
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock),
        kill_worker=lambda w: None,
    )
    rt.add_worker(WorkerConnection("w", "sim", 1, "h", FakeWriter()))  # type: ignore[arg-type]
    return rt


async def test_bulk_is_shed_first_and_interactive_keeps_a_reserve() -> None:
    rt = make_runtime()
    assert rt.capacity(BULK) == 30 and rt.capacity(INTERACTIVE) == 40
    rt.enqueue([b"b"] * 30, None, BULK)
    with pytest.raises(Overloaded, match="queue is full"):
        rt.enqueue([b"b"], None, BULK)
    rt.enqueue([b"i"] * 10, None, INTERACTIVE)  # the reserve
    with pytest.raises(Overloaded):
        rt.enqueue([b"i"], None, INTERACTIVE)
    await asyncio.sleep(0)


async def test_busy_worker_is_not_staged_a_batch_with_bulk_work() -> None:
    rt = make_runtime()
    rt.enqueue([b"first"] * 10, None, INTERACTIVE)
    rt.dispatch_due()  # one full batch running
    rt.enqueue([b"bulk"] * 10, None, BULK)
    rt.dispatch_due()
    (worker,) = rt.workers
    assert len(worker.inflight) == 1, "a bulk batch must not be staged ahead of later interactive work"
    rt.enqueue([b"inter"] * 10, None, INTERACTIVE)
    rt.dispatch_due()
    staged = list(worker.inflight.values())[-1]
    assert [i.payload for i in staged.items] == [b"inter"] * 10


@pytest.mark.parametrize(
    ("param", "header", "expected"),
    [
        (None, None, INTERACTIVE),
        ("bulk", None, BULK),
        (None, "BULK", BULK),
        (None, "interactive", INTERACTIVE),
        (1, None, INTERACTIVE),
        (2, "interactive", BULK),
        (None, "3", BULK),
        (0, None, INTERACTIVE),
    ],
)
def test_priority_parsing(param, header, expected) -> None:
    assert parse_priority(param, header) == expected


@pytest.mark.parametrize("bad", ["urgent", -1, True, 2.5])
def test_bad_priority_is_refused(bad) -> None:
    with pytest.raises(BadRequest, match="priority"):
        parse_priority(bad, None)


async def test_a_stalled_event_loop_sheds_bulk_first_then_everyone() -> None:
    rt = make_runtime()
    rt.loop_lag_s = 0.06  # over the 50 ms bound
    with pytest.raises(Overloaded, match="front end is saturated") as info:
        rt.precheck(BULK)
    assert info.value.reason == "front_end_saturated"
    rt.precheck(INTERACTIVE)  # interactive still admitted until twice the bound
    rt.loop_lag_s = 0.11
    with pytest.raises(Overloaded, match="front end is saturated"):
        rt.precheck(INTERACTIVE)
    rt.loop_lag_s = 0.0
    rt.precheck(BULK)


async def test_bulk_fills_a_batch_up_to_the_mixed_cap() -> None:
    """sim-like cost 100 ms + 1 ms/item, full batch 200 ms: with interactive traffic the cap is 0.95 x 200
    = 190 ms = 90 items; interactive items go first, bulk fills the rest."""
    rt2 = make_runtime_big()
    for size in (4, 8, 16, 32):
        rt2.estimator.observe_batch(size, 0.100 + 0.001 * size)
    rt2.enqueue([b"b"] * 200, None, BULK)
    rt2.enqueue([b"i"] * 5, None, INTERACTIVE)
    rt2.dispatch_due()
    (worker,) = rt2.workers
    (batch,) = worker.inflight.values()
    kinds = [i.payload for i in batch.items]
    assert kinds[:5] == [b"i"] * 5 and len(kinds) == 90


def make_runtime_big() -> ModelRuntime:
    clock = FakeClock()
    rt = ModelRuntime(
        sim_config(max_batch_size=100, max_queue_size=400, max_wait_ms=0.0),
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock),
        kill_worker=lambda w: None,
    )
    rt.add_worker(WorkerConnection("w", "sim", 1, "h", FakeWriter()))  # type: ignore[arg-type]
    return rt


async def test_bulk_alone_runs_full_batches_and_workers_stagger_under_mixed_load() -> None:
    """Bulk with no interactive traffic: full batches. With interactive traffic, two workers that would
    start equal batches together get sizes that put their finishes apart."""
    rt = make_runtime_big()
    rt.add_worker(WorkerConnection("w2", "sim", 2, "h", FakeWriter()))  # type: ignore[arg-type]
    for size in (4, 8, 16, 32):
        rt.estimator.observe_batch(size, 0.100 + 0.001 * size)
    rt.enqueue([b"b"] * 300, None, BULK)
    rt.dispatch_due()
    assert sorted(len(b.items) for w in rt.workers for b in w.inflight.values()) == [100, 100]
    for w in rt.workers:
        w.inflight.clear()
    rt.clock.advance(1.0)
    rt.enqueue([b"i"] * 3, None, INTERACTIVE)
    rt.dispatch_due()
    sizes = sorted(len(b.items) for w in rt.workers for b in w.inflight.values())
    assert len(sizes) == 2 and sizes[1] <= 90 and sizes[1] - sizes[0] >= 20, sizes
