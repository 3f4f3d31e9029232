"""SLO batching (`batching = "slo"`) in the real dispatch code (ModelRuntime), with a fake clock and fake
workers that can be lost: every request is answered exactly once (a result of its own, its deadline's
DeadlineExceeded, or a cancellation it asked for), no batch exceeds the device's limit, and an item is
never in two places at once, although the policy takes items from the middle of the queue (the ones that
can still meet the SLO before the lost ones) and a lost worker's batches go back to its head; with
[slo] shed_lost, a 429 comes only with it, always with reason slo_lost (which items: test_slo_shed.py)."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.errors import DeadlineExceeded, Overloaded, ServingError
from inferd.kinds.batch.dispatcher import ItemResult, ModelRuntime
from inferd.kinds.batch.queue import ItemState
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing import OutlierEjector
from inferd.routing.retry import RetryBudget
from tests.fakes.worker import fake_connection
from tests.property.test_batching_policy import TICK, Fleet

LATENCY_MS = 60.0


def slo_fleet(max_batch: int, queue_size: int, n_workers: int, shed: bool = False) -> Fleet:
    clock = FakeClock()
    config = sim_config(
        max_batch_size=max_batch,
        max_wait_ms=2.0,
        max_queue_size=queue_size,
        batching="slo",
        slo={"latency_ms": LATENCY_MS, "shed_lost": shed},
        max_attempts=5,
    )
    ejector = OutlierEjector(clock, latency_ratio=1000.0)
    rt = ModelRuntime(
        config,
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock, 1.0, 1000.0),
        lambda w: None,
        ejector=ejector,
    )
    fleet = Fleet(rt, clock, {})
    for i in range(n_workers):
        add_worker(fleet, f"w{i}")
    return fleet


def add_worker(fleet: Fleet, worker_id: str) -> None:
    fleet.rt.add_worker(fake_connection(worker_id, 100 + len(fleet.speeds)))
    fleet.speeds[worker_id] = (0.004, 0.001)


def lose_worker(fleet: Fleet, pick: int) -> None:
    """A worker's process dies (its running and staged batches are recovered); a new one replaces it."""
    workers = fleet.rt.members.connections()
    if not workers:
        return
    worker = workers[pick % len(workers)]
    fleet.rt.on_worker_lost(worker, "killed in a test")
    add_worker(fleet, f"r{len(fleet.speeds)}")
    fleet._woken = True  # a worker's arrival wakes the dispatch loop (the harness models arrivals only)
    fleet.advance(TICK)


def check_one_place(fleet: Fleet) -> None:
    """Queued items are in the queue once; an item is never queued and running at once."""
    queued = fleet.rt.queue.live_items()
    assert len({id(i) for i in queued}) == len(queued) == len(fleet.rt.queue)
    assert all(i.state is ItemState.QUEUED for i in queued)
    running = [
        i for w in fleet.rt.workers for b in w.inflight.values() for i in b.items if i.batch_id == b.batch_id
    ]
    assert not {id(i) for i in queued} & {id(i) for i in running}


events = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive", "burst", "burst", "cancel", "wait", "wait", "lose"]),
        st.integers(min_value=0, max_value=60),
        st.one_of(st.none(), st.integers(min_value=1, max_value=300)),
    ),
    min_size=1,
    max_size=100,
)


async def play(fleet: Fleet, evs: list[tuple[str, int, int | None]]) -> None:
    for kind, value, deadline_ms in evs:
        deadline_s = None if deadline_ms is None else deadline_ms / 1000.0
        if kind == "arrive":
            fleet.arrive(1, deadline_s)
        elif kind == "burst":
            fleet.arrive(value, deadline_s)
        elif kind == "cancel":
            fleet.cancel(value)
        elif kind == "lose":
            lose_worker(fleet, value)
        else:
            fleet.advance(value / 1000.0)
        check_one_place(fleet)
    fleet.run_until_idle(limit_s=30.0)


@settings(max_examples=120, deadline=None)
@given(
    max_batch=st.integers(1, 32),
    queue_size=st.integers(32, 128),
    n_workers=st.integers(1, 3),
    evs=events,
    shed=st.booleans(),
)
def test_slo_batching_answers_every_request_exactly_once(max_batch, queue_size, n_workers, evs, shed) -> None:
    fleet = slo_fleet(max_batch, queue_size, n_workers, shed)
    asyncio.run(play(fleet, evs))
    assert all(1 <= len(b.rids) <= max_batch for b in fleet.sent)
    assert set(fleet.items) | fleet.rejected == set(range(fleet.next_rid))
    assert len(fleet.rt.queue) == 0
    for rid, item in fleet.items.items():
        assert item.reply.done(), f"request {rid} was never answered"
        if item.reply.cancelled():
            assert rid in fleet.cancelled_at
            continue
        exc = item.reply.exception()
        if isinstance(exc, Overloaded):  # shed: it could no longer meet the SLO ([slo] shed_lost)
            assert shed and exc.reason == "slo_lost", exc
            continue
        if exc is not None:  # its deadline, or retries spent on lost workers
            assert isinstance(exc, ServingError), exc
            if isinstance(exc, DeadlineExceeded):
                assert item.deadline is not None
            continue
        result: ItemResult = item.reply.result()
        assert result.outputs["OUTPUT0"] == item.payload, "a result went to another request"
    for rid, sent_before in fleet.cancelled_at.items():
        assert all(rid not in b.rids for b in fleet.sent[sent_before:]), f"request {rid} ran after it left"
