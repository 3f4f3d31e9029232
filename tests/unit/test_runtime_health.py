"""Health is forward progress: a model with work and no completions is not ready, whatever a ping says."""

from __future__ import annotations

from inferd.clock import FakeClock
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection
from tests.property.test_recovery_state_machine import FakeWriter


def runtime(clock: FakeClock, killed: list[WorkerConnection]) -> tuple[ModelRuntime, WorkerConnection]:
    cfg = sim_config(max_wait_ms=0.0, progress_timeout_s=2.0, batch_timeout_s=5.0)
    rt = ModelRuntime(
        cfg, clock, Metrics().for_model("sim"), RetryBudget(clock), killed.append, heartbeat_timeout_s=3.0
    )
    worker = WorkerConnection("w0", "sim", 1, "h", FakeWriter())  # type: ignore[arg-type]
    rt.add_worker(worker)
    return rt, worker


async def test_work_without_completions_makes_the_model_unready() -> None:
    clock, killed = FakeClock(), []
    rt, worker = runtime(clock, killed)
    assert rt.ready
    items = rt.enqueue([b"a"], None)
    rt.dispatch_due()
    clock.advance(1.5)
    worker.last_heartbeat = clock.now()  # the worker still answers pings
    assert rt.ready
    clock.advance(1.0)
    worker.last_heartbeat = clock.now()
    assert rt.stalled() and not rt.ready
    batch_id = next(iter(worker.inflight))
    rt.on_batch_done(worker, p.BatchDone(batch_id, 0.01, outputs=[{"OUTPUT0": b"x"}]))
    assert rt.ready and items[0].reply.done()


async def test_watchdog_kills_hung_and_silent_workers() -> None:
    clock, killed = FakeClock(), []
    rt, worker = runtime(clock, killed)
    rt.enqueue([b"a"], None)
    rt.dispatch_due()
    clock.advance(4.0)
    worker.last_heartbeat = clock.now()
    rt.check_workers()
    assert killed == []
    clock.advance(1.5)  # the batch has run 5.5 s: over the 5 s batch timeout
    worker.last_heartbeat = clock.now()
    rt.check_workers()
    assert killed == [worker] and "hung" in worker.failure
    rt.on_worker_lost(worker, "killed")
    silent = WorkerConnection("w1", "sim", 2, "h", FakeWriter())  # type: ignore[arg-type]
    rt.add_worker(silent)
    clock.advance(3.5)
    rt.check_workers()
    assert killed[-1] is silent and "no heartbeat" in silent.failure
