"""A lost worker's staged batch (sent behind the one it was running): a crashed worker never started it,
but one cut off by the network may have run it. It goes back to the queue for an idempotent model, and
fails with WorkerDied, never re-run, for a model that is not idempotent."""

from __future__ import annotations

from inferd.clock import FakeClock
from inferd.errors import WorkerDied
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.kinds.batch.queue import QueuedItem
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.wire.connection import WorkerConnection
from tests.fakes.worker import fake_connection


def runtime_with_staged_batch(
    idempotent: bool,
) -> tuple[ModelRuntime, WorkerConnection, list[QueuedItem], list[QueuedItem]]:
    """One worker running a batch of two and holding a second batch of two staged behind it."""
    clock = FakeClock()
    rt = ModelRuntime(
        sim_config(max_batch_size=2, max_wait_ms=0.0, idempotent=idempotent),
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock),
        kill_worker=lambda w: None,
    )
    worker = fake_connection("remote-1", 100)
    rt.add_worker(worker)
    running = rt.enqueue([b"a", b"b"], None)
    rt.dispatch_due()
    staged = rt.enqueue([b"c", b"d"], None)
    rt.dispatch_due()
    assert len(worker.inflight) == 2 and len(rt.queue) == 0
    return rt, worker, running, staged


async def test_staged_batch_of_a_model_that_is_not_idempotent_fails_and_is_never_requeued() -> None:
    rt, worker, running, staged = runtime_with_staged_batch(idempotent=False)
    rt.on_worker_lost(worker, "connection reset")
    assert len(rt.queue) == 0 and not rt.isolation, "nothing of the lost worker's runs again"
    for item in running + staged:
        exc = item.reply.exception()
        assert isinstance(exc, WorkerDied) and "not idempotent" in exc.message
    assert "may have run it" in staged[0].reply.exception().message  # type: ignore[union-attr]


async def test_staged_batch_of_an_idempotent_model_goes_back_to_the_queue_uncounted() -> None:
    rt, worker, running, staged = runtime_with_staged_batch(idempotent=True)
    rt.on_worker_lost(worker, "connection reset")
    assert [i.payload for i in rt.queue.live_items()] == [b"c", b"d"]
    assert all(i.attempts == 0 for i in staged), "sent but maybe never run: not an attempt"
    assert not any(i.reply.done() for i in running + staged)
    assert [[i.payload for i in group] for group in rt.isolation] == [[b"a"], [b"b"]]
