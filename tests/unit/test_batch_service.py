"""BatchService (kinds/batch/service.py), the one enqueue / wait / withdraw of a batch model, on a real
ModelRuntime with a FakeClock and fake worker connections. The dispatch loop is not running: a test
dispatches with `dispatch_due()` (right after the enqueue, through `Watched`), and plays the workers'
answers itself. A deadline the FakeClock has already reached fires on the event loop's next turn, so
no test waits on the wall clock.

And the rule that makes it the only one: nothing in src/inferd outside kinds/batch queues, withdraws or
expires a batch model's items itself."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from inferd.clock import FakeClock
from inferd.errors import ClientGone, DeadlineExceeded, ModelError, Overloaded
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.kinds.batch.queue import QueuedItem
from inferd.kinds.batch.service import BatchService
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.fairness import BULK, INTERACTIVE, NO_TENANT, TenantShare
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection
from tests.fakes.worker import fake_connection

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "inferd"


def runtime(workers: int = 1, max_batch: int = 4) -> ModelRuntime:
    clock = FakeClock()
    rt = ModelRuntime(
        sim_config(max_batch_size=max_batch, max_wait_ms=0.0, idempotent=True),
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock),
        kill_worker=lambda w: None,
    )
    for i in range(workers):
        rt.add_worker(fake_connection(f"sim-{i}.1", 100 + i))
    return rt


class Watched:
    """The runtime as its service sees it, recording what was queued (`enqueued` is set then) and, with
    `dispatch`, sending what is due right after each enqueue, as the dispatch loop would; then the clock
    moves on by `then_s` (a batch that runs that long)."""

    def __init__(self, rt: ModelRuntime, dispatch: bool = False, then_s: float = 0.0) -> None:
        self.rt = rt
        self.clock = rt.clock
        self.dispatch = dispatch
        self.then_s = then_s
        self.items: list[QueuedItem] = []
        self.calls: list[tuple[Any, ...]] = []
        self.withdrawn: list[QueuedItem] = []
        self.enqueued = asyncio.Event()

    def enqueue(
        self, payloads: Sequence[Any], deadline: float | None, priority: int, tenant: TenantShare
    ) -> list[QueuedItem]:
        self.calls.append((list(payloads), deadline, priority, tenant))
        items = self.rt.enqueue(payloads, deadline, priority, tenant)
        self.items.extend(items)
        if self.dispatch:
            self.rt.dispatch_due()
        self.rt.clock.advance(self.then_s)  # type: ignore[attr-defined]
        self.enqueued.set()
        return items

    def withdraw(self, items: Sequence[QueuedItem]) -> None:
        self.withdrawn.extend(items)
        self.rt.withdraw(items)

    def expire(self, items: Sequence[QueuedItem]) -> None:
        self.rt.expire(items)


class Peer:
    """A caller's connection that knows when it is gone (as the front door's Exchange does)."""

    def __init__(self) -> None:
        self.watchers: list[Callable[[], None]] = []
        self.watched = 0

    def watch(self, on_gone: Callable[[], None]) -> Callable[[], None]:
        self.watched += 1
        self.watchers.append(on_gone)
        return lambda: self.watchers.remove(on_gone)

    def leave(self) -> None:
        for on_gone in list(self.watchers):
            on_gone()


def running(rt: ModelRuntime) -> tuple[WorkerConnection, int]:
    """The worker holding a batch, and that batch's id."""
    worker = next(w for w in rt.members.connections() if w.inflight)
    return worker, next(iter(worker.inflight))


def answer(
    rt: ModelRuntime, worker: WorkerConnection, batch_id: int, errors: dict[int, tuple[str, str]] | None = None
) -> None:
    """The worker's answer to `batch_id`: each item's payload back, or the (code, message) that `errors`
    gives for its index in the batch."""
    batch, errors = worker.inflight[batch_id], errors or {}
    outputs = [None if n in errors else {"OUTPUT0": i.payload} for n, i in enumerate(batch.items)]
    rt.on_batch_done(worker, p.BatchDone(batch_id, 0.01, outputs=outputs, item_errors=errors))


def frames(rt: ModelRuntime) -> int:
    return sum(len(w.writer.frames) for w in rt.members.connections())  # type: ignore[attr-defined]


# ---- results -------------------------------------------------------------------------------------------
async def test_infer_returns_every_items_result_in_order_and_stops_watching() -> None:
    rt, peer = runtime(), Peer()
    seen = Watched(rt, dispatch=True)
    call = asyncio.create_task(
        BatchService(seen).infer([b"a", b"b", b"c"], deadline=rt.clock.now() + 10.0, gone=peer.watch)
    )
    await seen.enqueued.wait()
    answer(rt, *running(rt))
    results = await call
    assert [r.outputs for r in results] == [{"OUTPUT0": b"a"}, {"OUTPUT0": b"b"}, {"OUTPUT0": b"c"}]
    assert {r.batch_size for r in results} == {3}
    assert peer.watched == 1 and peer.watchers == []  # the watch was dropped with the wait
    assert seen.withdrawn == []
    assert rt.statistics().queued == 0 and rt.statistics().in_flight == 0


async def test_infer_passes_deadline_priority_and_tenant_to_admission() -> None:
    rt = runtime()
    seen, tenant = Watched(rt, dispatch=True), TenantShare("acme", 2.0)
    deadline = rt.clock.now() + 10.0
    call = asyncio.create_task(
        BatchService(seen).infer([b"a"], deadline=deadline, priority=BULK, share=tenant)
    )
    await seen.enqueued.wait()
    answer(rt, *running(rt))
    await call
    assert seen.calls == [([b"a"], deadline, BULK, tenant)]
    (item,) = seen.items
    assert (item.deadline, item.priority, item.tenant) == (deadline, BULK, tenant)


async def test_the_runtimes_own_service_serves_it_with_its_dispatch_loop_running() -> None:
    rt = runtime()
    (worker,) = rt.members.connections()
    loop = asyncio.create_task(rt.run())
    try:
        async with asyncio.timeout(5):
            call = asyncio.create_task(rt.service.infer([b"a"], deadline=rt.clock.now() + 10.0))
            sent = await worker.writer.frame(0)  # type: ignore[attr-defined]
            rt.on_message(worker, p.BatchDone(sent.batch_id, 0.01, outputs=[{"OUTPUT0": b"a"}]))
            (result,) = await call
        assert result.outputs == {"OUTPUT0": b"a"}
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop


# ---- the deadline: admission, expiry in the queue, expiry while the batch runs ----------------------------
async def test_a_request_that_cannot_meet_its_deadline_is_refused_and_nothing_is_queued() -> None:
    rt = runtime()
    rt.estimator.observe_batch(4, 0.5)  # a batch takes 500 ms
    seen = Watched(rt)
    with pytest.raises(Overloaded, match="cannot meet the deadline"):
        await BatchService(seen).infer([b"a"], deadline=rt.clock.now() + 0.1)
    assert len(rt.queue) == 0 and seen.items == []


async def test_refuse_late_off_admits_past_the_estimate_and_still_expires_at_the_deadline() -> None:
    rt = runtime()
    rt.estimator.observe_batch(4, 0.5)
    seen = Watched(rt)
    with pytest.raises(DeadlineExceeded, match="in the queue"):
        await BatchService(seen).infer([b"a"], deadline=rt.clock.now(), refuse_late=False)
    assert seen.calls[0][1] is None  # admission was not given the deadline
    assert rt.dispatch_due() is None and frames(rt) == 0


async def test_items_past_their_deadline_expire_in_the_queue_and_are_never_dispatched() -> None:
    rt = runtime()
    seen = Watched(rt)  # nothing is dispatched while the request waits
    with pytest.raises(DeadlineExceeded, match=r"missed its deadline after 0 ms in the queue"):
        await BatchService(seen).infer([b"a", b"b"], deadline=rt.clock.now())
    assert all(isinstance(i.reply.exception(), DeadlineExceeded) for i in seen.items)
    assert len(rt.queue) == 0
    rt.dispatch_due()
    assert frames(rt) == 0, "an expired item reached a worker"
    assert rt.statistics().queued == 0


async def test_an_item_expired_while_its_batch_ran_gets_one_answer_and_the_late_result_goes_nowhere() -> None:
    rt = runtime()
    seen = Watched(rt, dispatch=True, then_s=0.2)  # the batch is sent, and runs past the deadline
    with pytest.raises(DeadlineExceeded, match=r"missed its deadline after 200 ms while its batch ran"):
        await BatchService(seen).infer([b"a"], deadline=rt.clock.now() + 0.1)
    seen.then_s = 0.0
    (late,) = seen.items
    worker, batch_id = running(rt)
    answer(rt, worker, batch_id)  # the worker answers after the deadline: nobody is told
    assert isinstance(late.reply.exception(), DeadlineExceeded)
    seen.enqueued.clear()
    call = asyncio.create_task(BatchService(seen).infer([b"next"], deadline=None))
    await seen.enqueued.wait()
    answer(rt, *running(rt))
    (result,) = await call
    assert result.outputs == {"OUTPUT0": b"next"}, "a request got another's answer"


# ---- withdraw: cancelled, caller gone, a failed item -------------------------------------------------------
async def test_cancelling_the_wait_withdraws_the_items_and_raises_cancelled() -> None:
    rt, peer = runtime(), Peer()
    seen = Watched(rt)
    call = asyncio.create_task(BatchService(seen).infer([b"a", b"b"], deadline=None, gone=peer.watch))
    await seen.enqueued.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert seen.withdrawn == seen.items and all(i.reply.cancelled() for i in seen.items)
    assert len(rt.queue) == 0 and peer.watchers == []
    rt.dispatch_due()
    assert frames(rt) == 0, "a withdrawn item reached a worker"


async def test_a_caller_that_goes_away_gets_client_gone_and_its_items_are_withdrawn() -> None:
    rt, peer = runtime(), Peer()
    seen = Watched(rt)
    call = asyncio.create_task(
        BatchService(seen).infer([b"a"], deadline=rt.clock.now() + 10.0, gone=peer.watch)
    )
    await seen.enqueued.wait()
    peer.leave()
    with pytest.raises(ClientGone):
        await call
    assert seen.withdrawn == seen.items and len(rt.queue) == 0 and peer.watchers == []
    rt.dispatch_due()
    assert frames(rt) == 0


async def test_a_caller_gone_while_its_batch_runs_leaves_the_answer_to_nobody() -> None:
    rt, peer = runtime(), Peer()
    seen = Watched(rt, dispatch=True)
    call = asyncio.create_task(BatchService(seen).infer([b"a"], deadline=None, gone=peer.watch))
    await seen.enqueued.wait()
    worker, batch_id = running(rt)
    peer.leave()
    with pytest.raises(ClientGone):
        await call
    answer(rt, worker, batch_id)
    assert seen.items[0].reply.cancelled()
    assert rt.statistics().in_flight == 0


async def test_cancelled_as_the_caller_leaves_stays_a_cancellation() -> None:
    rt, peer = runtime(), Peer()
    seen = Watched(rt)
    call = asyncio.create_task(BatchService(seen).infer([b"a"], deadline=None, gone=peer.watch))
    await seen.enqueued.wait()
    peer.leave()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert seen.withdrawn == seen.items


async def test_a_caller_already_gone_is_seen_at_once() -> None:
    rt = runtime()
    seen = Watched(rt)

    def gone(on_gone: Callable[[], None]) -> Callable[[], None]:
        on_gone()  # the connection was lost before the wait began
        return lambda: None

    with pytest.raises(ClientGone):
        await BatchService(seen).infer([b"a"], deadline=None, gone=gone)
    assert seen.withdrawn == seen.items and len(rt.queue) == 0


async def test_one_failed_item_fails_the_request_and_withdraws_the_others() -> None:
    rt = runtime(workers=2, max_batch=1)
    seen = Watched(rt, dispatch=True)
    call = asyncio.create_task(BatchService(seen).infer([b"a", b"b", b"c"], deadline=None))
    await seen.enqueued.wait()
    first, second, third = seen.items  # a and b run (one per worker); c waits staged or queued
    worker = next(w for w in rt.members.connections() if first.batch_id in w.inflight)
    answer(rt, worker, first.batch_id, {0: ("ModelError", "input a is poison")})
    with pytest.raises(ModelError, match="input a is poison"):
        await call
    assert seen.withdrawn == seen.items
    assert second.reply.cancelled() and third.reply.cancelled()
    assert rt.statistics().queued == 0


async def test_a_caller_that_leaves_after_its_answer_changes_nothing() -> None:
    rt, peer = runtime(), Peer()
    seen = Watched(rt, dispatch=True)
    call = asyncio.create_task(BatchService(seen).infer([b"a"], deadline=None, gone=peer.watch))
    await seen.enqueued.wait()
    answer(rt, *running(rt))
    (result,) = await call
    peer.leave()  # nobody watches any more
    assert result.outputs == {"OUTPUT0": b"a"} and seen.withdrawn == []


# ---- the one place ---------------------------------------------------------------------------------------
ALLOWED = {
    # The fleet simulator runs the real ModelRuntime on a virtual clock in one synchronous event loop of
    # its own: it admits each arrival itself and never awaits a reply, so no wait exists to share.
    "fleetsim/batch_fleet.py": "the simulator admits arrivals on its virtual clock and awaits nothing",
}
QUEUE_CALLS = frozenset({"enqueue", "withdraw", "expire"})


def queue_calls(tree: ast.AST) -> list[int]:
    """Lines that call `.enqueue(...)`, `.withdraw(...)` or `.expire(...)` on anything."""
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in QUEUE_CALLS
    )


def test_the_queue_call_finder_sees_calls_and_nothing_else() -> None:
    tree = ast.parse("rt.enqueue([b'a'], None)\nx = rt.withdraw\nself.rt.expire(items)\nenqueue(1)\n")
    assert queue_calls(tree) == [1, 3]


def test_nothing_outside_kinds_batch_queues_or_withdraws_batch_items_itself() -> None:
    found: dict[str, list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("kinds/batch/"):
            continue
        lines = queue_calls(ast.parse(path.read_text(), str(path)))
        if lines:
            found[rel] = lines
    unexpected = {rel: lines for rel, lines in found.items() if rel not in ALLOWED}
    assert not unexpected, (
        f"these modules call enqueue/withdraw/expire themselves; go through the model's BatchService "
        f"(rt.service.infer, kinds/batch/service.py) instead: {unexpected}"
    )
    assert set(ALLOWED) <= set(found), f"stale exceptions: {set(ALLOWED) - set(found)}"


async def test_defaults_are_interactive_and_no_tenant() -> None:
    rt = runtime()
    seen = Watched(rt)
    with pytest.raises(DeadlineExceeded):
        await BatchService(seen).infer([b"a"], deadline=rt.clock.now())
    assert seen.calls[0][2:] == (INTERACTIVE, NO_TENANT)
