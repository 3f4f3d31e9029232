"""Fairness between tenants (routing/fairness.py) under arbitrary arrivals, cuts, withdrawals, expiries
and retries (hypothesis RuleBasedStateMachine on a FakeClock), on the real RequestQueue.

Invariants: no item is lost or duplicated (every item is in exactly one place: queued, cut, expired,
displaced, withdrawn); a batch never exceeds its size, interactive items before bulk; a tenant is refused
queue room only when it would go over its weighted share, and only tenants over their shares give way;
for two tenants backlogged throughout, |S_i / w_i - S_j / w_j| <= 1/w_i + 1/w_j (S: batch slots).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inferd.clock import FakeClock
from inferd.errors import Overloaded
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.kinds.batch.queue import QueuedItem, RequestQueue
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.fairness import BULK, INTERACTIVE, NO_TENANT, TenantShare
from inferd.routing.retry import RetryBudget
from inferd.wire.connection import WorkerConnection
from tests.fakes.worker import FakeWriter

MAX = 24
CAPACITY = {INTERACTIVE: MAX, BULK: MAX - 8}  # as ModelRuntime.capacity: bulk leaves a reserve
NAMES = ("a", "b", "c")
WEIGHT = st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0])


def share_of(q: RequestQueue, weights: dict[str, float], tenant: str, priority: int, arriving: str) -> float:
    """Independently of the queue's code: `tenant`'s share of the class's room, counting the tenants
    waiting in the class and the `arriving` one."""
    held = q.held_in(priority)
    waiting = {t for t, c in held.items() if c > 0} | {arriving}
    room = CAPACITY[priority] - (len(q) - q.live_in(priority))
    return room * weights[tenant] / sum(weights[t] for t in waiting)


class FairQueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.q = RequestQueue(MAX)
        self.weights: dict[str, float] = {}
        self.where: dict[int, str] = {}
        self.retried: set[int] = set()
        self.items: dict[int, QueuedItem] = {}
        self.seq = itertools.count()
        self.slots = {(p, t): 0 for p in (INTERACTIVE, BULK) for t in NAMES}
        self.baseline: dict[tuple[int, str, str], tuple[int, int]] = {}

    @initialize(weights=st.tuples(WEIGHT, WEIGHT, WEIGHT))
    def tenants(self, weights: tuple[float, float, float]) -> None:
        self.weights = dict(zip(NAMES, weights, strict=True))

    # ---- rules ---------------------------------------------------------------------------------------
    @rule(
        tenant=st.sampled_from(NAMES),
        n=st.integers(1, 5),
        priority=st.sampled_from([INTERACTIVE, BULK]),
        ttl=st.none() | st.floats(0.5, 5.0),
    )
    def arrive(self, tenant: str, n: int, priority: int, ttl: float | None) -> None:
        q, share = self.q, TenantShare(tenant, self.weights[tenant])
        held, cap = q.held_in(priority), CAPACITY[priority]
        mine = share_of(q, self.weights, tenant, priority, tenant)
        shares = {t: share_of(q, self.weights, t, priority, tenant) for t in held}
        taken = q.room_for(share, n, priority, cap)
        if taken is None:  # refused: only when it does not fit AND the tenant would go over its share
            assert n > cap - len(q)
            assert held.get(tenant, 0) + n > mine - 1e-9
            return
        if n <= cap - len(q):
            assert taken == {}
        if taken:
            event("displaced")
        for victim, k in taken.items():  # each item given up came from a tenant over its share
            assert victim != tenant
            assert held[victim] - k + 1 > shares[victim] - 1e-9
        for item in q.displace(priority, taken):
            assert self.where[id(item)] == "queued"
            self.where[id(item)] = "displaced"
            newer = [  # retried items go back to the head of the lane: they give way last
                i
                for i in q.live_items()
                if (i.tenant.name, i.priority) == (item.tenant.name, priority)
                and id(i) not in self.retried
                and i.payload > item.payload
            ]
            assert not newer and item.priority == priority, "displaced an item that was not the newest"
        now = self.clock.now()
        for _ in range(n):
            deadline = None if ttl is None else now + ttl
            item = QueuedItem(next(self.seq), now, deadline, priority=priority, tenant=share)
            q.push(item)
            self.items[id(item)] = item
            self.where[id(item)] = "queued"
        assert len(q) <= max(cap, MAX)

    @rule(size=st.integers(1, 8))
    def cut(self, size: int) -> None:
        now = self.clock.now()
        batch, expired = self.q.cut(size, now)
        assert len(batch) <= size
        priorities = [i.priority for i in batch]
        assert priorities == sorted(priorities), "bulk before interactive"
        for item in batch:
            assert self.where[id(item)] == "queued"
            assert item.deadline is None or item.deadline > now
            self.where[id(item)] = "cut"
            self.slots[(item.priority, item.tenant.name)] += 1
        for item in expired:
            assert self.where[id(item)] == "queued" and item.deadline is not None and item.deadline <= now
            self.where[id(item)] = "expired"

    @rule(pick=st.integers(0, 10_000))
    def withdraw(self, pick: int) -> None:
        queued = [i for i in self.items.values() if self.where[id(i)] == "queued"]
        if queued:
            item = queued[pick % len(queued)]
            assert self.q.withdraw(item)
            self.where[id(item)] = "withdrawn"

    @rule(pick=st.integers(0, 10_000), count=st.integers(1, 4))
    def retry(self, pick: int, count: int) -> None:
        """Items of a lost batch go back to the head of their lanes."""
        running = [i for i in self.items.values() if self.where[id(i)] == "cut"]
        back = running[pick % len(running) :][:count] if running else []
        self.q.push_front(back)
        for item in back:
            self.where[id(item)] = "queued"
            self.retried.add(id(item))

    @rule(dt=st.floats(0.1, 2.0))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)

    # ---- invariants ----------------------------------------------------------------------------------
    @invariant()
    def every_item_in_one_place(self) -> None:
        live = self.q.live_items()
        assert len({id(i) for i in live}) == len(live) == len(self.q)
        assert {id(i) for i in live} == {k for k, w in self.where.items() if w == "queued"}
        for p in (INTERACTIVE, BULK):
            assert sum(self.q.held_in(p).values()) == self.q.live_in(p)

    @precondition(lambda self: bool(self.weights))
    @invariant()
    def backlogged_tenants_share_slots_by_weight(self) -> None:
        for p in (INTERACTIVE, BULK):
            held = self.q.held_in(p)
            for i, j in itertools.combinations(NAMES, 2):
                key = (p, i, j)
                if not (held.get(i) and held.get(j)):
                    self.baseline.pop(key, None)
                    continue
                if key not in self.baseline:
                    self.baseline[key] = (self.slots[(p, i)], self.slots[(p, j)])
                    continue
                bi, bj = self.baseline[key]
                wi, wj = self.weights[i], self.weights[j]
                gap = (self.slots[(p, i)] - bi) / wi - (self.slots[(p, j)] - bj) / wj
                assert abs(gap) <= 1 / wi + 1 / wj + 1e-9, (p, i, j, gap)
                if self.slots[(p, i)] > bi and self.slots[(p, j)] > bj:
                    event("two backlogged tenants both served")


FairQueueMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestFairQueue = FairQueueMachine.TestCase


@settings(max_examples=150, deadline=None)
@given(
    weights=st.lists(WEIGHT, min_size=2, max_size=4),
    sizes=st.lists(st.integers(1, 16), min_size=1, max_size=60),
)
def test_backlogged_slot_shares_converge_to_weight_shares(weights: list[float], sizes: list[int]) -> None:
    """Every tenant backlogged throughout: after T slots, |S_i - T w_i / W| <= 1 + n w_i / W (n tenants),
    which follows from the pairwise bound; so S_i / T -> w_i / W."""
    tenants = [TenantShare(f"t{k}", w) for k, w in enumerate(weights)]
    q = RequestQueue(10_000)
    slots = dict.fromkeys((t.name for t in tenants), 0)
    for t in tenants:
        for _ in range(20):
            q.push(QueuedItem(0, 0.0, None, tenant=t))
    for size in sizes:
        batch, _ = q.cut(size, now=0.0)
        for item in batch:
            slots[item.tenant.name] += 1
        for t in tenants:  # keep everyone backlogged
            for _ in range(20 - q.held_in(INTERACTIVE).get(t.name, 0)):
                q.push(QueuedItem(0, 0.0, None, tenant=t))
    total, weight = sum(slots.values()), sum(weights)
    for t in tenants:
        assert abs(slots[t.name] - total * t.weight / weight) <= 1 + len(tenants) * t.weight / weight + 1e-9


@settings(max_examples=200, deadline=None)
@given(held=st.integers(0, 40), n=st.integers(1, 8), priority=st.sampled_from([INTERACTIVE, BULK]))
def test_without_tenants_room_is_the_plain_bound(held: int, n: int, priority: int) -> None:
    """No tenant configured: one implicit tenant, admitted exactly when the items fit, nothing displaced."""
    q = RequestQueue(40)
    for k in range(held):
        q.push(QueuedItem(k, 0.0, None, priority=priority))
    cap = 40 if priority == INTERACTIVE else 30
    assert q.room_for(NO_TENANT, n, priority, cap) == ({} if held + n <= cap else None)


def make_runtime(queue_size: int = 40) -> ModelRuntime:
    clock = FakeClock()
    rt = ModelRuntime(
        sim_config(max_batch_size=10, max_queue_size=queue_size),
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock),
        kill_worker=lambda w: None,
    )
    rt.add_worker(WorkerConnection("w", "sim", 1, "h", FakeWriter()))  # type: ignore[arg-type]
    return rt


async def test_a_flooding_tenant_gives_way_and_gets_the_429s() -> None:
    rt = make_runtime()
    a, b = TenantShare("a", 1.0), TenantShare("b", 1.0)
    flood = [rt.enqueue([b"a"], None, INTERACTIVE, a)[0] for _ in range(40)]  # alone: the whole queue
    with pytest.raises(Overloaded, match="tenant 'a' already holds 40"):
        rt.enqueue([b"a"], None, INTERACTIVE, a)
    mine = rt.enqueue([b"b"] * 5, None, INTERACTIVE, b)  # within its share (20): A's newest give way
    gave_way = [i for i in flood if i.reply.done()]
    assert [i.payload for i in mine] == [b"b"] * 5 and flood[-5:] == gave_way
    for item in gave_way:
        with pytest.raises(Overloaded, match="tenant 'a' holds more than its share"):
            item.reply.result()
    assert len(rt.queue) == 40 and rt.queue.held_in(INTERACTIVE) == {"a": 35, "b": 5}
    batch, _ = rt.queue.cut(10, rt.clock.now())  # equal weights: the slots alternate
    assert [i.tenant.name for i in batch].count("b") == 5
    rt.withdraw(flood + mine)
    await asyncio.sleep(0)


async def test_a_tenant_over_its_share_waits_for_room_as_before() -> None:
    rt = make_runtime()
    a, b = TenantShare("a", 3.0), TenantShare("b", 1.0)
    items = [i for _ in range(40) for i in rt.enqueue([b"a"], None, INTERACTIVE, a)]
    items += rt.enqueue([b"b"] * 10, None, INTERACTIVE, b)  # share 40 * 1/4 = 10
    with pytest.raises(Overloaded, match="tenant 'b' already holds 10"):
        rt.enqueue([b"b"], None, INTERACTIVE, b)
    assert rt.queue.held_in(INTERACTIVE) == {"a": 30, "b": 10}
    for item in items[30:40]:  # the ten A gave up
        assert isinstance(item.reply.exception(), Overloaded)
    rt.withdraw(items)
    await asyncio.sleep(0)


RUNTIME_TENANTS = {"a": TenantShare("a", 1.0), "b": TenantShare("b", 2.0), "": NO_TENANT}


def arrivals(kind: str, sizes: st.SearchStrategy[int]) -> st.SearchStrategy[tuple[str, str, int, int]]:
    return st.tuples(st.just(kind), st.sampled_from(sorted(RUNTIME_TENANTS)), sizes, st.sampled_from([0, 1]))


runtime_ops = st.lists(
    st.one_of(
        arrivals("arrive", st.integers(1, 6)),
        arrivals("arrive", st.integers(1, 6)),
        arrivals("flood", st.integers(10, 20)),  # one request after another until refused
        st.tuples(st.just("cut"), st.just(""), st.integers(1, 10), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops=runtime_ops)
def test_runtime_refuses_room_only_over_share_and_answers_every_item_once(ops: list[tuple]) -> None:
    """The real admission (precheck and enqueue, both classes, the bulk reserve): a refusal for room
    means the tenant would go over its share; every admitted item ends in exactly one place."""

    async def scenario() -> None:
        rt = make_runtime(queue_size=16)  # bulk may fill 6 of it
        admitted: list[QueuedItem] = []
        cut: list[QueuedItem] = []

        def arrive(name: str, n: int, priority: int) -> bool:
            tenant = RUNTIME_TENANTS[name]
            held = rt.queue.held_in(priority)
            waiting = {t for t, c in held.items() if c} | {tenant.name}
            weights = {t: RUNTIME_TENANTS[t].weight for t in waiting}
            room = rt.capacity(priority) - (len(rt.queue) - rt.queue.live_in(priority))
            share = room * tenant.weight / sum(weights.values())
            try:
                admitted.extend(rt.enqueue([b"x"] * n, None, priority, tenant))
            except Overloaded as exc:
                event("refused for room")
                assert exc.reason == "queue_full"
                assert len(rt.queue) + n > rt.capacity(priority), "refused with room free"
                assert held.get(tenant.name, 0) + n > share - 1e-9, "refused within its share"
                return False
            finally:
                assert len(rt.queue) <= rt.capacity(INTERACTIVE)
            return True

        for kind, name, n, priority in ops:
            if kind == "cut":
                batch, expired = rt.queue.cut(n, rt.clock.now())
                assert not expired and len(batch) <= n
                cut.extend(batch)
            elif kind == "arrive":
                arrive(name, n, priority)
            else:
                for _ in range(n):
                    if not arrive(name, 1, priority):
                        break
        live = {id(i) for i in rt.queue.live_items()}
        displaced = {
            id(i) for i in admitted if i.reply.done() and isinstance(i.reply.exception(), Overloaded)
        }
        ran = {id(i) for i in cut}
        if displaced:
            event("items displaced")
        assert len(live) + len(displaced) + len(ran) == len(admitted), "an item lost or in two places"
        assert not (live & displaced) and not (live & ran) and not (ran & displaced)
        rt.withdraw(admitted)
        await asyncio.sleep(0)

    asyncio.run(scenario())


async def test_a_request_gives_way_whole() -> None:
    """Displacing part of a multi-item request takes its other items out too: the request fails as a
    whole (429) and none of its items runs for nobody."""
    rt = make_runtime()
    a, b = TenantShare("a", 1.0), TenantShare("b", 1.0)
    requests = [rt.enqueue([b"a"] * 4, None, INTERACTIVE, a) for _ in range(10)]  # the whole queue
    mine = rt.enqueue([b"b"], None, INTERACTIVE, b)  # needs one place: A's newest request goes
    assert all(isinstance(i.reply.exception(), Overloaded) for i in requests[-1])
    assert not any(i.reply.done() for r in requests[:-1] for i in r)
    assert rt.queue.held_in(INTERACTIVE) == {"a": 36, "b": 1}
    rt.withdraw([i for r in requests for i in r] + mine)
    await asyncio.sleep(0)
