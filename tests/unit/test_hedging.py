"""Hedging a batch on a slow worker (RELIABILITY F3): past 3x its expected time its items go to another
worker, the first answer wins, nothing is answered twice or lost, and the queue's count stays right."""

from __future__ import annotations

import asyncio

import pytest

from inferd.clock import FakeClock
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.kinds.batch.hedging import HedgeInput, HedgePolicy
from inferd.kinds.batch.queue import QueuedItem
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing import OutlierEjector
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from inferd.wire.connection import Batch, WorkerConnection
from tests.fakes.worker import FakeWriter, fake_connection


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
    from inferd.errors import ShuttingDown

    rt.stop(ShuttingDown("bye"))
    assert len(rt.queue) == 0


# ---- the policy alone: a plain object on a fake clock ----------------------------------------------------
LINE = (0.100, 0.001)
"""A batch costs 100 ms + 1 ms per item: 104 ms for 4 items, so it is overdue past 312 ms."""


def policy(balance_requests: int = 100) -> tuple[HedgePolicy, FakeClock, RetryBudget]:
    clock = FakeClock()
    budget = RetryBudget(clock, ratio=0.2, min_per_s=0.0)
    budget.record_requests(balance_requests)
    ejector = OutlierEjector(clock)
    for wid in ("slow", "fast"):
        ejector.add(wid)
    for _ in range(3):  # the fleet's reference: 50 ms, so past 150 ms the slow worker is slow for it
        ejector.observe("fast", 0.050)
    return HedgePolicy(clock, budget, ejector), clock, budget


def batch(batch_id: int, n: int, sent_at: float) -> Batch:
    loop = asyncio.get_running_loop()
    items = [QueuedItem(f"{batch_id}-{k}", sent_at, None, loop.create_future()) for k in range(n)]
    for item in items:
        item.attempts, item.batch_id = 1, batch_id
    return Batch(batch_id, items, sent_at, fake_connection("slow", 1))


def slow_worker(batches: list[Batch], since: float, **overrides) -> HedgeInput:
    fields = dict(
        worker_id="slow",
        batches=batches,
        running_since=since,
        others_ready=True,
        cost_line=LINE,
        idempotent=True,
        max_attempts=3,
    )
    return HedgeInput(**{**fields, **overrides})


async def test_policy_hedges_past_three_times_the_expected_time_running_and_staged_items() -> None:
    hedging, clock, budget = policy()
    running, staged = batch(1, 4, clock.now()), batch(2, 2, clock.now())
    s = slow_worker([running, staged], clock.now())
    clock.advance(0.300)
    assert hedging.decide(s) is None, "slow against the fleet, but not yet 3 x the expected 104 ms"
    balance = budget.balance()
    clock.advance(0.050)
    decision = hedging.decide(s)
    assert decision is not None
    assert decision.items == tuple(running.items + staged.items)
    assert decision.batches == (running, staged) and decision.retried == 4
    assert decision.age_s == pytest.approx(0.350) and decision.expected_s == pytest.approx(0.104)
    assert budget.balance() == balance - 4, "running items spend the retry budget; staged ones go free"


async def test_policy_leaves_alone_what_it_must_not_hedge() -> None:
    hedging, clock, _ = policy()
    running = batch(1, 4, clock.now())
    since = clock.now()
    clock.advance(1.0)
    assert hedging.decide(slow_worker([running], since, idempotent=False)) is None
    assert hedging.decide(slow_worker([running], since, others_ready=False)) is None
    assert hedging.decide(slow_worker([running], since, cost_line=None)) is None
    running.hedged = True
    assert hedging.decide(slow_worker([running], since)) is None, "a batch is decided on once"


async def test_policy_does_not_hedge_a_fleet_wide_slowdown() -> None:
    hedging, clock, _ = policy()
    for _ in range(3):
        hedging.ejector.observe("fast", 1.0)  # the others are as slow now
    running = batch(1, 4, clock.now())
    since = clock.now()
    clock.advance(1.0)
    assert hedging.decide(slow_worker([running], since)) is None


async def test_policy_skips_suspect_items_and_running_items_the_budget_cannot_pay_for() -> None:
    hedging, clock, budget = policy(balance_requests=0)  # an empty budget
    running, staged = batch(1, 4, clock.now()), batch(2, 4, clock.now())
    staged.items[0].crashes = 1  # crashed a worker before: a poison suspect
    staged.items[1].isolation_round = 1  # being isolated
    staged.items[2].hedged = True  # a copy already
    staged.items[3].attempts = 3  # out of attempts
    clock.advance(1.0)
    decision = hedging.decide(slow_worker([running, staged], clock.now() - 1.0))
    assert decision is not None and decision.items == () and decision.retried == 0
    assert decision.batches == (running, staged), "still marked: decided on once"
    assert budget.statistics().exhausted_total == 1
