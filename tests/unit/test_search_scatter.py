"""One shard's request in the scatter: failover to another replica when one fails, a hedge to a second
replica when the first is slow (within the budget), and nothing (not an error) by the deadline."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from inferd.clock import MonotonicClock
from inferd.errors import WorkerDied, from_wire
from inferd.kinds.search.hedge import HedgePolicy
from inferd.kinds.search.replicas import Replica, ReplicaChooser, ReplicaPhase
from inferd.kinds.search.scatter import Scatter
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerState


class FakeCalls:
    """Replicas that answer at once, fail at once, or never answer."""

    def __init__(self, behaviour: dict[str, str]) -> None:
        self.replicas = [
            Replica(SimpleNamespace(worker_id=w, state=WorkerState.READY), 0, ReplicaPhase.SERVING)  # type: ignore[arg-type]
            for w in behaviour
        ]
        self.behaviour = behaviour
        self.asked: list[str] = []
        self.open: dict[int, asyncio.Future[p.ShardReply]] = {}

    def shard_replicas(self, shard: int) -> list[Replica]:
        return self.replicas

    def call(self, replica: Replica, op: str, body: bytes) -> tuple[int, asyncio.Future[p.ShardReply]]:
        self.asked.append(replica.worker_id)
        fut: asyncio.Future[p.ShardReply] = asyncio.get_running_loop().create_future()
        how = self.behaviour[replica.worker_id]
        if how == "answer":
            fut.set_result(p.ShardReply(len(self.asked), 0, 0, body=replica.worker_id.encode()))
        elif how == "fail":
            fut.set_exception(WorkerDied(f"{replica.worker_id} died"))
        self.open[len(self.asked)] = fut
        return len(self.asked), fut

    def forget(self, replica: Replica, call_id: int) -> None:
        self.open.pop(call_id, None)

    @staticmethod
    def answer(reply: p.ShardReply) -> bytes:
        if reply.error is not None:
            raise from_wire(*reply.error)
        return reply.body


def scatter(calls: FakeCalls, **hedge: float) -> Scatter:
    clock = MonotonicClock()
    policy = HedgePolicy(clock, shards=1, initial_delay_s=0.001, **hedge)  # type: ignore[arg-type]
    return Scatter(calls, policy, ReplicaChooser(random.Random(0)), clock)


async def ask(s: Scatter, timeout_s: float = 5.0) -> bytes | None:
    return await s.ask(0, "search", b"", 0, s.clock.now() + timeout_s)


async def test_a_failed_replica_is_replaced_by_another() -> None:
    calls = FakeCalls({"a": "fail", "b": "answer"})
    s = scatter(calls)
    answers = {await ask(s) for _ in range(10)}
    assert answers == {b"b"}
    assert "a" in calls.asked  # it was chosen, and failed over
    assert calls.open == {}  # every call forgotten once answered


async def test_a_slow_replica_is_hedged_and_the_other_answers() -> None:
    calls = FakeCalls({"slow": "hang", "fast": "answer"})
    s = scatter(calls)
    while calls.asked[:1] != ["slow"]:  # until the first choice is the slow one
        calls.asked.clear()
        assert await ask(s) == b"fast"
    assert calls.asked == ["slow", "fast"]
    assert s.hedge.statistics().hedges == 1
    assert calls.open == {}  # the slow call is forgotten too


async def test_without_budget_a_hanging_shard_is_left_out_at_the_deadline() -> None:
    calls = FakeCalls({"slow": "hang", "other": "hang"})
    s = scatter(calls, ratio=0.0, burst=0.0)
    s.hedge.try_hedge()  # spend the one token it starts with
    assert await ask(s, timeout_s=0.05) is None
    assert len(calls.asked) == 1
    assert s.hedge.statistics().denied == 1


async def test_a_shard_with_no_replica_answers_nothing_at_once() -> None:
    calls = FakeCalls({})
    assert await ask(scatter(calls)) is None


async def test_a_read_is_never_hedged_or_failed_over_to_a_replica_behind_its_min_seq() -> None:
    for how in ("hang", "fail"):
        calls = FakeCalls({"stale": "answer", "fresh": how})
        stale, fresh = calls.replicas
        stale.applied_seq, fresh.applied_seq = 5, 10
        fresh.slow = True  # a slow verdict does not make the only fresh replica's read a probe
        s = scatter(calls)
        assert await s.ask(0, "search", b"", 10, s.clock.now() + 0.05) is None  # left out, not stale
        assert calls.asked == ["fresh"], how
        assert s.hedge.statistics().hedges == 0
        assert await s.ask(0, "search", b"", 5, s.clock.now() + 5.0) == b"stale"  # where it is fresh enough
