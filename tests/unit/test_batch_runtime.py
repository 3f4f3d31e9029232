"""ModelRuntime as a Runtime (runtime/contract.py): its snapshots, its worker membership, messages from
workers, `stop`, and `run` (the dispatch loop and the watchdog together, on the real event loop)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from inferd.clock import FakeClock
from inferd.errors import Internal, ShuttingDown, WorkerUnavailable
from inferd.kinds.batch.dispatcher import ItemResult, ModelRuntime
from inferd.kinds.batch.statistics import BatchStatistics, BatchWorkerDetail
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing import Health
from inferd.routing.retry import RetryBudget
from inferd.runtime.contract import Runtime, RuntimeStatistics
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection
from tests.fakes.worker import FakeWriter, fake_connection


def runtime(max_batch: int = 4, workers: int = 2, broken: bool = False) -> ModelRuntime:
    clock = FakeClock()
    rt = ModelRuntime(
        sim_config(max_batch_size=max_batch, max_wait_ms=0.0, idempotent=True, version=3),
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock),
        kill_worker=lambda w: None,
    )
    for i in range(workers):
        rt.add_worker(fake_connection(f"sim-{i}.1", 100 + i, broken=broken))
    return rt


def done(worker: WorkerConnection, compute_s: float = 0.02) -> p.BatchDone:
    """The answer to the worker's running batch: each item's own payload back."""
    batch = next(iter(worker.inflight.values()))
    return p.BatchDone(batch.batch_id, compute_s, outputs=[{"OUTPUT0": i.payload} for i in batch.items])


def holding(rt: ModelRuntime) -> list[WorkerConnection]:
    return [w for w in rt.members.connections() if w.inflight]


async def test_model_runtime_is_a_runtime_of_the_batch_kind() -> None:
    rt = runtime()
    assert isinstance(rt, Runtime)
    assert rt.kind == "batch" and rt.accepts_workers
    assert rt.version == 3
    rt.config = sim_config(version=4)  # a rolling update: workers that connect now load version 4
    assert rt.version == 4 and rt.statistics().version == 4


async def test_statistics_count_queued_isolated_and_in_flight_items() -> None:
    rt = runtime()
    rt.enqueue([b"a", b"b", b"c", b"d"], None)
    rt.dispatch_due()
    rt.enqueue([b"e", b"f", b"g", b"h"], None)
    rt.dispatch_due()  # both workers run a full batch
    rt.enqueue([b"i", b"j", b"k"], None)
    rt.dispatch_due()  # a partial batch is not staged behind a running one: it stays queued
    crashed, survivor = holding(rt)
    rt.on_worker_lost(crashed, "killed")  # its batch of 4 waits in two isolation halves

    stats = rt.statistics()
    assert isinstance(stats, RuntimeStatistics) and isinstance(stats.detail, BatchStatistics)
    assert (stats.name, stats.kind, stats.ready, stats.ready_workers) == ("sim", "batch", True, 1)
    assert stats.queued == 3 + 4 and stats.in_flight == 4
    d = stats.detail
    assert (d.queued_items, d.queued_interactive, d.queued_bulk, d.queue_capacity) == (3, 3, 0, 16)
    assert (d.isolation_batches, d.isolated_items, d.inflight_batches) == (2, 4, 1)
    assert (d.enqueued_total, d.max_batch_size, d.stalled) == (11, 4, False)
    assert d.batch_latency_s is None and d.batch_timeout_s == 30.0 and d.busy_ratio == 0.0
    (w,) = stats.workers
    assert (w.worker_id, w.model, w.version, w.state, w.pid, w.load) == ("sim-1.1", "sim", 1, "ready", 101, 1)
    assert w.detail == BatchWorkerDetail(
        slot_id="sim-1",
        inflight_batches=1,
        latency_s=rt.balancer.prior_latency_s,
        ejection=rt.ejection_status(survivor),
    )
    assert w.detail.ejection.health is Health.READY

    rt.clock.advance(0.05)
    rt.on_batch_done(survivor, done(survivor))
    after = rt.statistics()
    assert after.in_flight == 0 and after.workers[0].completed == 1
    assert after.detail.batch_latency_s == pytest.approx(0.05) and after.detail.items_per_batch == 4
    assert after.workers[0].detail.latency_s == pytest.approx(0.05)
    assert stats.in_flight == 4 and stats.workers[0].completed == 0, "a snapshot never changes"
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.detail.queued_items = 0  # type: ignore[misc]


async def test_its_membership_lists_the_ready_and_draining_workers() -> None:
    rt = runtime(workers=3)
    ready, draining, lost = rt.members.connections()
    rt.drain_worker(draining)
    rt.on_worker_lost(lost, "connection reset")
    assert rt.members.connections() == (ready, draining)
    assert [w.state for w in rt.statistics().workers] == ["ready", "draining"]
    assert rt.statistics().ready_workers == 1


async def test_on_message_settles_a_batch_done_and_ignores_anything_else(caplog) -> None:
    rt = runtime(workers=1)
    (item,) = rt.enqueue([b"a"], None)
    rt.dispatch_due()
    (worker,) = rt.members.connections()
    with caplog.at_level(logging.WARNING, logger="inferd.dispatcher"):
        rt.on_message(worker, p.Heartbeat(running=1, completed_batches=0))
    assert not item.reply.done() and "Heartbeat" in caplog.text
    rt.on_message(worker, done(worker))
    result: ItemResult = item.reply.result()
    assert result.outputs == {"OUTPUT0": b"a"} and result.batch_size == 1


async def test_stop_fails_queued_and_isolated_items_and_refuses_new_work() -> None:
    rt = runtime()
    running = rt.enqueue([b"a", b"b", b"c", b"d"], None)
    rt.dispatch_due()
    isolated = rt.enqueue([b"e", b"f", b"g", b"h"], None)
    rt.dispatch_due()
    queued = rt.enqueue([b"i"], None)
    crashed = next(w for w in holding(rt) if isolated[0].batch_id in w.inflight)
    rt.on_worker_lost(crashed, "killed")
    rt.stop(ShuttingDown("model 'sim' is shutting down"))
    for item in isolated + queued:
        assert isinstance(item.reply.exception(), ShuttingDown)
    assert not any(i.reply.done() for i in running), "running work is not stopped: it finishes or is lost"
    stats = rt.statistics()
    assert stats.queued == 0 and stats.in_flight == 4
    with pytest.raises(WorkerUnavailable, match="shutting down"):
        rt.enqueue([b"j"], None)


async def test_run_sends_batches_when_work_arrives_and_when_a_worker_answers() -> None:
    """Each step below waits for a frame the loop could only send if that event woke it: after a frame
    is seen the loop has sent everything then due, and sleeps until the next event."""
    clock = FakeClock()
    rt = ModelRuntime(
        sim_config(max_batch_size=1, max_wait_ms=0.0),
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock),
        kill_worker=lambda w: None,
    )
    frames = FakeWriter()  # both workers' frames, in sending order
    for i in range(2):
        rt.add_worker(fake_connection(f"sim-{i}.1", 100 + i, writer=frames))
    task = asyncio.create_task(rt.run())
    try:
        async with asyncio.timeout(5):
            a, _ = rt.enqueue([b"a"], None) + rt.enqueue([b"b"], None)
            assert {(await frames.frame(n)).items[0] for n in (0, 1)} == {b"a", b"b"}  # one on each worker
            rt.enqueue([b"c"], None)  # an arrival: staged behind a running batch
            assert (await frames.frame(2)).items == [b"c"]
            _, e = rt.enqueue([b"d", b"e"], None)  # d fills the last free slot; e must wait
            assert (await frames.frame(3)).items == [b"d"]
            first = next(w for w in rt.members.connections() if a.batch_id in w.inflight)
            rt.on_message(first, done(first))  # a completion frees a slot for e
            assert (await frames.frame(4)) == p.RunBatch(e.batch_id, [b"e"])
        assert a.reply.result().outputs == {"OUTPUT0": b"a"}
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_run_fails_queued_work_with_internal_when_the_dispatch_loop_breaks() -> None:
    rt = runtime(max_batch=1, workers=1, broken=True)
    items = rt.enqueue([b"a", b"b", b"c"], None)
    with pytest.raises(ConnectionResetError):
        async with asyncio.timeout(5):
            await rt.run()
    for item in items[1:]:  # the first was in the batch whose sending failed
        exc = item.reply.exception()
        assert isinstance(exc, Internal) and "dispatch loop of model 'sim' failed" in exc.message
        assert "ConnectionResetError" in exc.message
    with pytest.raises(WorkerUnavailable, match="shutting down"):
        rt.precheck()


async def test_run_also_runs_the_watchdog_that_kills_a_hung_worker() -> None:
    clock = FakeClock()
    killed: asyncio.Future[WorkerConnection] = asyncio.get_running_loop().create_future()
    rt = ModelRuntime(
        sim_config(max_wait_ms=0.0, batch_timeout_s=1.0),
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock),
        kill_worker=killed.set_result,
        heartbeat_timeout_s=60.0,
    )
    worker = fake_connection("sim-0.1", 100)
    rt.add_worker(worker)
    rt.enqueue([b"a"], None)
    task = asyncio.create_task(rt.run())
    try:
        async with asyncio.timeout(5):
            await worker.writer.frame(0)  # type: ignore[attr-defined]
            clock.advance(1.5)  # the batch has run past the 1 s batch timeout
            assert await killed is worker
        assert "hung" in worker.failure
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_the_batch_timeout_allows_a_full_batch_when_small_batches_dominate_the_average() -> None:
    # one-item queries at 10 ms between occasional 32-item document batches at 3 s (an embedder serving
    # a search index): 10x the average alone would call the next document batch hung
    rt = runtime(max_batch=32)
    for i in range(200):
        rt.estimator.observe_batch(1, 0.01)
        if i % 40 == 0:
            rt.estimator.observe_batch(32, 3.0)
    assert rt.estimator.batch_latency_s is not None and 10 * rt.estimator.batch_latency_s < 3.0
    assert rt.batch_timeout_s() >= 30.0


def test_replies_are_futures_of_the_loop_running_each_enqueue() -> None:
    """The runtime keeps the running loop instead of asking for it per request (a system call each
    time), and asks again once that loop has stopped: a reply is never a future of another loop."""
    rt = runtime()

    async def enqueue() -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
        (item,) = rt.enqueue([b"x"], deadline=None)
        (again,) = rt.enqueue([b"y"], deadline=None)
        assert again.reply.get_loop() is item.reply.get_loop()
        return item.reply.get_loop(), asyncio.get_running_loop()

    first, running = asyncio.run(enqueue())
    assert first is running
    second, running = asyncio.run(enqueue())
    assert second is running and second is not first
