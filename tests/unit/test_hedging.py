"""Hedging a batch on a slow worker (RELIABILITY F3): past 3x its expected time its items go to another
worker, the first answer wins, nothing is answered twice or lost, and the queue's count stays right."""

from __future__ import annotations

from inferd.batching.dispatcher import ModelRuntime
from inferd.batching.retry import RetryBudget
from inferd.clock import FakeClock
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.worker import protocol as p
from inferd.worker.connection import WorkerConnection
from tests.property.test_recovery_state_machine import FakeWriter


def runtime(idempotent: bool = True) -> tuple[ModelRuntime, WorkerConnection, WorkerConnection]:
    clock = FakeClock()
    rt = ModelRuntime(
        sim_config(max_batch_size=8, max_wait_ms=0.0, idempotent=idempotent),
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock),
        kill_worker=lambda w: None,
    )
    slow = WorkerConnection("slow", "sim", 1, "h", FakeWriter())  # type: ignore[arg-type]
    fast = WorkerConnection("fast", "sim", 2, "h", FakeWriter())  # type: ignore[arg-type]
    rt.add_worker(slow)
    for size in (2, 4, 8):
        rt.estimator.observe_batch(size, 0.100 + 0.001 * size)  # ~104 ms for 4 items
    rt.ejector.add("fast")
    for _ in range(3):  # the fleet's reference: the fast worker's batches take ~104 ms
        rt.ejector.observe("fast", 0.104)
    rt.budget.record_requests(100)
    return rt, slow, fast


def done(batch_id: int, n: int, tag: bytes) -> p.BatchDone:
    return p.BatchDone(batch_id, 0.1, outputs=[{"OUTPUT0": tag}] * n)


async def test_slow_batch_is_hedged_and_the_first_answer_wins() -> None:
    rt, slow, fast = runtime()
    items = rt.enqueue([b"a", b"b", b"c", b"d"], None)
    rt.dispatch_due()
    (original,) = slow.inflight.values()
    rt.add_worker(fast)  # a second worker joins while the first is busy
    rt.clock.advance(0.2)
    rt.check_workers()
    assert not fast.inflight, "not hedged before 3x the expected time"
    rt.clock.advance(0.15)  # 350 ms > 3 x ~104 ms
    rt.check_workers()
    assert len(rt.queue) == 4
    rt.dispatch_due()
    (copy,) = fast.inflight.values()
    assert [i.payload for i in copy.items] == [b"a", b"b", b"c", b"d"]
    rt.on_batch_done(fast, done(copy.batch_id, 4, b"fast"))
    assert [i.reply.result().outputs["OUTPUT0"] for i in items] == [b"fast"] * 4
    rt.on_batch_done(slow, done(original.batch_id, 4, b"slow"))  # late: answered already, ignored
    assert [i.reply.result().outputs["OUTPUT0"] for i in items] == [b"fast"] * 4
    assert len(rt.queue) == 0 and not slow.inflight and not fast.inflight


async def test_the_slow_original_answering_first_withdraws_the_queued_copies() -> None:
    rt, slow, fast = runtime()
    items = rt.enqueue([b"a", b"b"], None)
    rt.dispatch_due()
    (original,) = slow.inflight.values()
    fast.state = slow.state  # ready, but its connection is not used below
    rt.workers.append(fast)
    rt.clock.advance(0.5)
    rt.check_workers()
    assert len(rt.queue) == 2
    rt.on_batch_done(slow, done(original.batch_id, 2, b"slow"))
    assert [i.reply.result().outputs["OUTPUT0"] for i in items] == [b"slow"] * 2
    assert len(rt.queue) == 0, "answered copies left the queue"


async def test_losing_the_slow_worker_after_a_hedge_does_not_queue_the_items_again() -> None:
    rt, slow, fast = runtime()
    items = rt.enqueue([b"a", b"b", b"c"], None)
    rt.dispatch_due()
    rt.add_worker(fast)
    rt.clock.advance(0.5)
    rt.check_workers()
    rt.dispatch_due()
    (copy,) = fast.inflight.values()
    rt.on_worker_lost(slow, "killed")
    assert len(rt.queue) == 0 and not rt.isolation
    rt.on_batch_done(fast, done(copy.batch_id, 3, b"fast"))
    assert all(i.reply.result().outputs["OUTPUT0"] == b"fast" for i in items)


async def test_no_hedge_for_a_model_that_is_not_idempotent() -> None:
    rt, _slow, fast = runtime(idempotent=False)
    rt.enqueue([b"a"], None)
    rt.dispatch_due()
    rt.add_worker(fast)
    rt.clock.advance(1.0)
    rt.check_workers()
    assert len(rt.queue) == 0 and not fast.inflight


async def test_an_item_is_hedged_once_and_never_while_under_suspicion() -> None:
    """A hanging input must not be spread over the fleet: its copy is not hedged again, and an item that
    crashed a worker before (a poison suspect) is not hedged at all."""
    rt, slow, fast = runtime()
    third = WorkerConnection("third", "sim", 3, "h", FakeWriter())  # type: ignore[arg-type]
    (x,) = rt.enqueue([b"hangs"], None)
    rt.dispatch_due()
    rt.add_worker(fast)
    rt.add_worker(third)
    rt.clock.advance(0.35)
    rt.check_workers()
    rt.dispatch_due()
    holders = [w for w in (fast, third) if w.inflight]
    assert len(holders) == 1 and x.hedged
    rt.clock.advance(0.35)
    rt.check_workers()
    rt.dispatch_due()
    assert sum(1 for w in (slow, fast, third) if w.inflight) == 2, "the copy was not hedged again"
    (y,) = rt.enqueue([b"suspect"], None)
    y.crashes = 1
    free = next(w for w in (fast, third) if not w.inflight)
    rt.dispatch_due()
    assert free.inflight
    rt.clock.advance(0.35)
    rt.check_workers()
    assert len(rt.queue) == 0, "an item that crashed a worker is left to isolation, not hedged"


async def test_failing_the_queue_at_shutdown_keeps_the_count_right() -> None:
    rt, _slow, _fast = runtime()
    rt.enqueue([b"a", b"b", b"c"], None)
    rt.stop_accepting()
    from inferd.errors import ShuttingDown

    rt.fail_all_queued(ShuttingDown("bye"))
    assert len(rt.queue) == 0
