"""One runtime's workers (runtime/membership.py), as the batch, llm and search runtimes keep them: a
worker joins ready, drains once, is lost (dead, whatever it was), and each arrival or departure wakes the
fleet operations waiting on a change; the worker sides a kind declares (kinds/worker_sides.py) are
registered kinds'."""

from __future__ import annotations

import asyncio

from inferd.clock import FakeClock
from inferd.kinds.builtin import builtin_kinds
from inferd.kinds.worker_sides import WORKER_SIDES
from inferd.runtime.membership import Membership
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState
from tests.unit.test_llm_failover import RecordingWriter


def worker(name: str) -> tuple[WorkerConnection, RecordingWriter]:
    writer = RecordingWriter()
    return WorkerConnection(name, "m", 1, "local", writer), writer  # type: ignore[arg-type]


def drains_sent(writer: RecordingWriter) -> int:
    return sum(isinstance(m, p.Drain) for m in writer.sent)


async def test_a_worker_joins_ready_drains_once_and_leaves_dead_waking_the_waiters() -> None:
    clock = FakeClock()
    members = Membership(clock)
    a, a_writer = worker("a")
    b, _ = worker("b")
    waiter = asyncio.ensure_future(members.changed())
    await asyncio.sleep(0)
    assert not waiter.done()
    members.add(a)
    members.add(b)
    await asyncio.wait_for(waiter, 1)
    assert a.state is WorkerState.READY and a.last_progress == a.last_heartbeat == clock.now()
    assert members.connections() == (a, b)

    assert members.drain(a) and a.state is WorkerState.DRAINING
    assert not members.drain(a)  # told once
    assert drains_sent(a_writer) == 1
    assert members.connections() == (a, b)  # a draining worker still holds work

    waiter = asyncio.ensure_future(members.changed())
    await asyncio.sleep(0)
    assert members.lose(a) is WorkerState.DRAINING
    await asyncio.wait_for(waiter, 1)
    assert a.state is WorkerState.DEAD and members.connections() == (b,)
    assert not members.drain(a)
    b.state = WorkerState.DEAD  # killed, its connection not yet gone: no longer a live worker
    assert members.connections() == ()


def test_every_worker_side_is_a_registered_kinds() -> None:
    assert set(WORKER_SIDES) <= set(builtin_kinds().names())
