"""Batching invariants on the real dispatch code (ModelRuntime), a fake clock and fake workers (ROADMAP
Part 1, RELIABILITY 2.3.3): every request is answered exactly once, no batch exceeds the maximum, nobody
waits past max_wait (plus a tick) while a worker is free, cancelled and expired requests are never
dispatched, and order is FIFO (within a priority class; interactive work never leaves after later bulk).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.errors import DeadlineExceeded, Overloaded
from inferd.kinds.batch.dispatcher import ItemResult, ModelRuntime
from inferd.kinds.batch.queue import QueuedItem
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing import OutlierEjector
from inferd.routing.fairness import BULK, INTERACTIVE
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from tests.fakes.worker import fake_connection

TICK = 0.001


@dataclass
class Sent:
    at: float
    rids: list[int]


@dataclass
class Fleet:
    """Drives a real ModelRuntime tick by tick the way its dispatch loop and its workers would.

    The loop calls dispatch_due when woken (an arrival or a completion: what sets the runtime's wake-up
    event) or when the time it asked to be woken at has come, never otherwise. Each fake worker answers
    its running batch `base_s + per_item_s x size` after it reached the device. Deadlines are enforced
    the way the HTTP layer's timers do (`expire`), after the loop's turn at each tick."""

    rt: ModelRuntime
    clock: FakeClock
    speeds: dict[str, tuple[float, float]]
    items: dict[int, QueuedItem] = field(default_factory=dict)
    priority: dict[int, int] = field(default_factory=dict)
    rejected: set[int] = field(default_factory=set)
    cancelled_at: dict[int, int] = field(default_factory=dict)
    """Request id -> how many batches had been sent when its caller left."""
    sent: list[Sent] = field(default_factory=list)
    late: list[float] = field(default_factory=list)
    """At each tick with a free worker and work queued: how far past max_wait the oldest item is."""
    max_depth: int = 0
    next_rid: int = 0
    _seen: set[int] = field(default_factory=set)
    _woken: bool = True
    _wake_at: float | None = None

    @classmethod
    def build(
        cls,
        max_batch: int,
        max_wait_s: float,
        queue_size: int,
        n_workers: int,
        preferred: tuple[int, ...] = (),
    ) -> Fleet:
        clock = FakeClock()
        config = sim_config(
            max_batch_size=max_batch,
            max_wait_ms=max_wait_s * 1000.0,
            max_queue_size=queue_size,
            preferred_batch_sizes=preferred,
        )
        # Workers of different speeds, none an outlier: ejection has its own properties (test_balancer).
        ejector = OutlierEjector(clock, latency_ratio=1000.0)
        rt = ModelRuntime(
            config, clock, Metrics().for_model("sim"), RetryBudget(clock), lambda w: None, ejector=ejector
        )
        speeds = {}
        for i in range(n_workers):
            rt.add_worker(fake_connection(f"w{i}", 100 + i))
            speeds[f"w{i}"] = (0.005 + 0.003 * i, 0.0002)
        return cls(rt, clock, speeds)

    # ---- inputs ------------------------------------------------------------------------------------
    def arrive(self, n: int = 1, deadline_s: float | None = None, priority: int = INTERACTIVE) -> None:
        """`n` requests of one item each arrive together, then the loop gets its turn."""
        for _ in range(n):
            self._enqueue(deadline_s, priority)
        self._loop_turn()

    def _enqueue(self, deadline_s: float | None, priority: int) -> None:
        rid = self.next_rid
        self.next_rid += 1
        self.priority[rid] = priority
        deadline = None if deadline_s is None else self.clock.now() + deadline_s
        try:
            (item,) = self.rt.enqueue([rid.to_bytes(4, "big")], deadline, priority)
        except Overloaded:  # refused at admission: answered at once (429), never queued
            self.rejected.add(rid)
            return
        self.items[rid] = item
        self.max_depth = max(self.max_depth, len(self.rt.queue))
        self._woken = True

    def cancel(self, pick: int) -> None:
        """A caller leaves (its connection closed). The runtime is not woken for that."""
        if not self.items:
            return
        rid = list(self.items)[pick % len(self.items)]
        if not self.items[rid].reply.done():
            self.cancelled_at[rid] = len(self.sent)
        self.rt.withdraw([self.items[rid]])

    # ---- time --------------------------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        for _ in range(round(seconds / TICK)):
            self.tick()

    def tick(self) -> None:
        self.clock.advance(TICK)
        self._complete_due()
        self._loop_turn()
        self._expire_due()
        self._measure_lateness()

    def run_until_idle(self, limit_s: float = 5.0) -> None:
        """Until nothing is queued or running, or `limit_s` passed (far more than any scenario needs:
        the invariants then say what went wrong)."""
        for _ in range(round(limit_s / TICK)):
            busy = len(self.rt.queue) or self.rt.isolation or any(w.inflight for w in self.rt.workers)
            if not busy:
                return
            self.tick()

    # ---- what the workers, the loop and the timers do ----------------------------------------------
    def _complete_due(self) -> None:
        for w in self.rt.members.connections():
            base, per_item = self.speeds[w.worker_id]
            while w.inflight:
                batch = next(iter(w.inflight.values()))
                cost = base + per_item * len(batch.items)
                if w.running_since + cost > self.clock.now() + 1e-12:
                    break
                outputs = [{"OUTPUT0": i.payload} for i in batch.items]
                self.rt.on_batch_done(w, p.BatchDone(batch.batch_id, cost, outputs=outputs))
                self._woken = True

    def _loop_turn(self) -> None:
        due = self._wake_at is not None and self.clock.now() >= self._wake_at
        if not (self._woken or due):
            return
        self._woken = False
        self._wake_at = self.rt.dispatch_due()
        self._record_sent()

    def _record_sent(self) -> None:
        fresh = [b for w in self.rt.workers for b in w.inflight.values() if b.batch_id not in self._seen]
        for batch in sorted(fresh, key=lambda b: b.batch_id):  # ids are handed out in sending order
            self._seen.add(batch.batch_id)
            self.sent.append(Sent(self.clock.now(), [int.from_bytes(i.payload, "big") for i in batch.items]))

    def _expire_due(self) -> None:
        now = self.clock.now()
        late = [
            i
            for i in self.items.values()
            if not i.reply.done() and i.deadline is not None and i.deadline <= now
        ]
        if late:
            self.rt.expire(late)

    def _measure_lateness(self) -> None:
        oldest = self.rt.queue.oldest_at()
        if oldest is not None and any(w.idle for w in self.rt.members.connections()):
            self.late.append(self.clock.now() - (oldest + self.rt.config.max_wait_s))


def check_invariants(fleet: Fleet, max_batch: int, queue_size: int) -> None:
    flat = [rid for batch in fleet.sent for rid in batch.rids]
    # no batch over the max; nothing sent twice (no failures here: no retries)
    assert all(1 <= len(b.rids) <= max_batch for b in fleet.sent)
    assert len(flat) == len(set(flat)), "an item was dispatched twice"
    batch_of = {rid: k for k, b in enumerate(fleet.sent) for rid in b.rids}
    # every request answered exactly once: refused at admission, or its reply settled once, as it should be
    assert set(fleet.items) | fleet.rejected == set(range(fleet.next_rid))
    assert not set(fleet.items) & fleet.rejected
    for rid, item in fleet.items.items():
        assert item.reply.done(), f"request {rid} was never answered"
        if item.reply.cancelled():
            assert rid in fleet.cancelled_at
            continue
        exc = item.reply.exception()
        if exc is not None:
            assert isinstance(exc, DeadlineExceeded), exc
            assert item.deadline is not None
            continue
        result: ItemResult = item.reply.result()
        assert result.outputs["OUTPUT0"] == item.payload, "a result went to another request"
        assert rid in batch_of and result.batch_size == len(fleet.sent[batch_of[rid]].rids)
    # while a worker was free, nobody waited past max_wait plus one tick for its batch to be cut
    assert all(late <= TICK + 1e-9 for late in fleet.late), max(fleet.late)
    # the queue stayed within its bound; cancelled or expired requests were never dispatched
    assert fleet.max_depth <= queue_size
    for rid, sent_before in fleet.cancelled_at.items():
        assert all(rid not in b.rids for b in fleet.sent[sent_before:]), f"request {rid} ran after it left"
    for batch in fleet.sent:
        deadlines = [fleet.items[rid].deadline for rid in batch.rids]
        assert all(d is None or d > batch.at for d in deadlines), "an expired request was dispatched"
    # FIFO within each class, and interactive work never leaves after bulk work that arrived later
    for cls in (INTERACTIVE, BULK):
        order = [rid for rid in flat if fleet.priority[rid] == cls]
        assert order == sorted(order), f"class {cls} left out of order"
    position = {rid: n for n, rid in enumerate(flat)}
    for rid in flat:
        if fleet.priority[rid] == INTERACTIVE:
            later_bulk = [b for b in flat if fleet.priority[b] == BULK and b > rid]
            assert all(position[rid] < position[b] for b in later_bulk), "interactive left after later bulk"


events = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive", "arrive", "burst", "cancel", "wait"]),
        st.integers(min_value=0, max_value=40),  # wait in ms / burst size / cancel pick
        st.one_of(st.none(), st.integers(min_value=1, max_value=200)),  # deadline ms
        st.sampled_from([INTERACTIVE, INTERACTIVE, BULK]),
    ),
    min_size=1,
    max_size=120,
)


async def play(fleet: Fleet, evs: list[tuple[str, int, int | None, int]]) -> None:
    """The scenario runs inside an event loop: the runtime's replies are asyncio futures."""
    for kind, value, deadline_ms, priority in evs:
        deadline_s = None if deadline_ms is None else deadline_ms / 1000.0
        if kind == "arrive":
            fleet.arrive(1, deadline_s, priority)
        elif kind == "burst":
            fleet.arrive(value, deadline_s, priority)
        elif kind == "cancel":
            fleet.cancel(value)
        else:
            fleet.advance(value / 1000.0)
    fleet.run_until_idle()


@settings(max_examples=150, deadline=None)
@given(
    max_batch=st.integers(1, 16),
    max_wait_ms=st.integers(0, 30),
    queue_size=st.integers(16, 64),
    n_workers=st.integers(1, 3),
    evs=events,
)
def test_batching_invariants(max_batch, max_wait_ms, queue_size, n_workers, evs) -> None:
    fleet = Fleet.build(max_batch, max_wait_ms / 1000.0, queue_size, n_workers)
    asyncio.run(play(fleet, evs))
    check_invariants(fleet, max_batch, queue_size)


# ---- examples ------------------------------------------------------------------------------------------
def batches(fleet: Fleet) -> list[list[int]]:
    return [b.rids for b in fleet.sent]


async def test_lone_request_waits_max_wait_for_company() -> None:
    fleet = Fleet.build(100, 0.010, 1000, 1)
    fleet.arrive()
    fleet.advance(0.009)
    assert batches(fleet) == []
    fleet.advance(0.002)
    assert batches(fleet) == [[0]]
    fleet.run_until_idle()


async def test_full_batch_dispatches_without_waiting() -> None:
    fleet = Fleet.build(4, 0.050, 1000, 1)
    fleet.arrive(4)
    assert batches(fleet) == [[0, 1, 2, 3]]
    fleet.run_until_idle()


async def test_busy_worker_batch_keeps_filling_then_goes_at_once() -> None:
    fleet = Fleet.build(100, 0.010, 1000, 1)
    fleet.speeds["w0"] = (0.030, 0.0)
    fleet.arrive()
    fleet.advance(0.011)  # batch [0] cut at max_wait
    for _ in range(20):  # 20 arrive while the device is busy
        fleet.arrive()
        fleet.advance(0.001)
    assert batches(fleet) == [[0]]  # nothing small is staged while busy
    fleet.advance(0.011)  # the device frees at ~41 ms; the oldest has waited over max_wait
    assert batches(fleet)[1] == list(range(1, 21))
    fleet.run_until_idle()


async def test_full_batch_is_staged_on_busy_worker() -> None:
    fleet = Fleet.build(5, 0.010, 1000, 1)
    fleet.speeds["w0"] = (0.050, 0.0)
    fleet.arrive(10)
    assert batches(fleet) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # the second is staged
    fleet.arrive()
    assert len(batches(fleet)) == 2  # a staged batch already waits: no third
    fleet.run_until_idle()


async def test_preferred_batch_size_cut_at_once() -> None:
    fleet = Fleet.build(100, 0.050, 1000, 1, preferred=(4, 8))
    fleet.arrive(4)
    assert batches(fleet) == [[0, 1, 2, 3]]
    fleet.run_until_idle()


async def test_expired_items_never_take_a_batch_slot() -> None:
    fleet = Fleet.build(10, 0.005, 1000, 1)
    fleet.speeds["w0"] = (0.100, 0.0)
    fleet.arrive()
    fleet.advance(0.006)  # [0] runs for 100 ms
    fleet.arrive(1, deadline_s=0.020)
    fleet.arrive()
    fleet.run_until_idle()
    assert isinstance(fleet.items[1].reply.exception(), DeadlineExceeded)
    assert batches(fleet) == [[0], [2]]
