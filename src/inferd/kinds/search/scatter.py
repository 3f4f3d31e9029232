"""Scatter a query to one replica of each shard and gather what answers by the deadline.

Per shard: pick a replica (power of two choices among the fresh ones, on calls in flight times their
latency); if it has not answered after the shard's observed p95, hedge to a second replica within the
hedge budget (5% extra shard requests); if one fails (it died, it refused), ask another while time is
left. Every shard has the request's deadline (less a small margin to fuse and answer); a shard that has
not answered by then is left out of the coverage, never an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from inferd.clock import Clock
from inferd.errors import ServingError
from inferd.kinds.search import wire
from inferd.kinds.search.hedge import HedgePolicy
from inferd.kinds.search.replicas import Replica, ReplicaChooser
from inferd.kinds.search.types import ShardQuery, ShardResult
from inferd.observability import tracing
from inferd.wire import protocol as p

GATHER_MARGIN_S = 0.003
"""Time kept back from each shard's deadline to fuse the lists and answer."""


class Flight(NamedTuple):
    """A shard call in flight."""

    replica: Replica
    call_id: int
    sent: float
    span: tracing.Span | None
    probe: bool = False
    """The chooser made it a probe of a slow replica (hedged at once, may take the last hedge token)."""


class ShardCalls(Protocol):
    """What the scatter needs of the runtime (kinds/search/runtime.py)."""

    def shard_replicas(self, shard: int) -> list[Replica]: ...

    def call(self, replica: Replica, op: str, body: bytes) -> tuple[int, asyncio.Future[p.ShardReply]]: ...

    @staticmethod
    def forget(replica: Replica, call_id: int) -> None: ...

    @staticmethod
    def answer(reply: p.ShardReply) -> bytes: ...


class Scatter:
    def __init__(self, calls: ShardCalls, hedge: HedgePolicy, chooser: ReplicaChooser, clock: Clock) -> None:
        self.calls = calls
        self.hedge = hedge
        self.chooser = chooser
        self.clock = clock
        self.failures = 0
        """Shard calls that failed (a replica died or refused) and were asked elsewhere."""

    async def gather(
        self, query: ShardQuery, min_seq: Sequence[int], deadline: float
    ) -> list[ShardResult | None]:
        """Each shard's result, or None where no replica answered by the deadline."""
        body = wire.encode(query)
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(self.ask(shard, "search", body, seq, deadline))
                for shard, seq in enumerate(min_seq)
            ]
        return [wire.result(t.result()) if t.result() is not None else None for t in tasks]

    async def ask(self, shard: int, op: str, body: bytes, min_seq: int, deadline: float) -> bytes | None:
        """One shard's answer body, or None by the deadline. Hedged and failed over."""
        candidates = self.calls.shard_replicas(shard)
        tried: set[Replica] = set()
        flight: dict[asyncio.Future[p.ShardReply], Flight] = {}
        hedged = False
        try:
            while True:
                if not flight or (not hedged and self._hedge_due(shard, flight)):
                    replica = self.chooser.choose(candidates, min_seq, tried, self.clock.now())
                    probe = self.chooser.probed
                    if replica is None and not flight:
                        return None  # no live replica left to ask (none fresh, where a fresh one was)
                    if flight:  # a hedge: at most one per shard request, within the budget
                        hedged = True
                        if replica is not None and not self.hedge.try_hedge(self._first(flight).probe):
                            replica = None
                    elif not tried:
                        self.hedge.started()
                    if replica is not None:
                        failover = bool(tried) and not flight
                        self._send(shard, op, body, replica, flight, failover, probe)
                        tried.add(replica)
                wait_s = self._wait_s(shard, flight, hedged, deadline)
                if wait_s <= 0:
                    return None
                done, _ = await asyncio.wait(flight, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    replica, call_id, sent, span, _ = flight.pop(fut)
                    self.calls.forget(replica, call_id)
                    try:
                        result = self.calls.answer(fut.result())
                    except ServingError as exc:
                        self.failures += 1
                        tracing.end_span(span, outcome="failed", error=exc.code)
                        continue
                    now = self.clock.now()
                    self.hedge.observe(shard, now - sent)
                    replica.observe(now - sent, now)
                    tracing.end_span(span, outcome="answered")
                    return result
        finally:
            now = self.clock.now()
            for replica, call_id, sent, span, _ in flight.values():
                self.calls.forget(replica, call_id)
                replica.observe(now - sent, now, lower_bound=True)  # unanswered for this long
                tracing.end_span(span, outcome="abandoned")  # the other copy answered, or the deadline

    def _send(
        self, shard: int, op: str, body: bytes, replica: Replica, flight: dict, failover: bool, probe: bool
    ) -> None:
        """One call to one replica (a hedge when another is in flight), with its inferd.search.shard span."""
        span = tracing.start_span(
            "inferd.search.shard",
            shard=shard,
            op=op,
            replica=replica.worker_id,
            hedge=bool(flight),
            failover=failover,
        )
        try:
            call_id, fut = self.calls.call(replica, op, body)
        except ServingError as exc:
            tracing.end_span(span, outcome="failed", error=exc.code)
            raise
        flight[fut] = Flight(replica, call_id, self.clock.now(), span, probe)

    @staticmethod
    def _first(flight: dict) -> Flight:
        return min(flight.values(), key=lambda f: f.sent)

    def _hedge_due(self, shard: int, flight: dict) -> bool:
        first = self._first(flight)
        return self.clock.now() - first.sent >= self.hedge.delay_s(shard, first.probe)

    def _wait_s(self, shard: int, flight: dict, hedged: bool, deadline: float) -> float:
        now = self.clock.now()
        left = deadline - GATHER_MARGIN_S - now
        if hedged or not flight:
            return left
        first = self._first(flight)
        return min(left, max(0.0, first.sent + self.hedge.delay_s(shard, first.probe) - now) + 1e-4)
