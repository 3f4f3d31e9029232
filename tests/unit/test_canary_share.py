"""One canary decision for several front ends (gateway/traffic_control.py follower mode,
gateway/canary_share.py): the lease holder judges the sum of every front end's outcomes, steps on its
clock, and every front end applies its state; a new holder goes on from the `canary` document's state;
each outcome is judged once, whichever write fails and whoever holds the lease. On MemoryStore and a
fake clock."""

from __future__ import annotations

import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from inferd.clock import FakeClock
from inferd.cluster.follower import Follower
from inferd.cluster.memory import MemoryStore
from inferd.cluster.store import Fenced, Grant, StoreUnavailable, Versioned
from inferd.gateway import canary_share
from inferd.gateway.canary_share import (
    CANARY,
    CANARY_DOC,
    OUTCOMES_DOC,
    OUTCOMES_PREFIX,
    Batch,
    CanaryDoc,
    CanaryShare,
    Mark,
    OutcomesDoc,
)
from inferd.gateway.traffic import SplitState
from inferd.gateway.traffic_control import Outcomes, Traffic
from inferd.observability.traffic_metrics import TrafficMetrics
from inferd.runtime.registry import ModelRegistry
from tests.unit.test_traffic import Served, configs, no_header

ROLLBACK = {"max_error_ratio": 0.5, "short_window_s": 10, "long_window_s": 30, "min_requests": 10}
CANARY_TABLE = {"canary": {"version": 2, "weight": 0.5}, "rollback": ROLLBACK}
STEPS = {"canary": {"version": 2, "steps": [0.1, 0.5, 1.0], "step_interval_s": 60}}


def front_end(
    traffic: dict[str, Any], clock: FakeClock, follower: bool, seed: int = 1
) -> tuple[Traffic, CollectorRegistry]:
    registry = ModelRegistry()
    for c in configs(traffic):
        registry.add(Served(c))  # type: ignore[arg-type]
    prom = CollectorRegistry()
    t = Traffic(registry, clock, TrafficMetrics(prom), random.Random(seed), lambda: 5.0, follower=follower)
    return t, prom


def fail_canary(traffic: Traffic, clock: FakeClock, calls: int) -> None:
    v1, v2 = traffic.registry.get("m", 1), traffic.registry.get("m", 2)
    for _ in range(calls):
        clock.advance(0.2)
        traffic.observe(v1, "ok", 0.01)
        traffic.observe(v2, "model_error", 0.01)


def state(traffic: Traffic) -> str:
    return traffic.statistics().splits[0].state


def test_the_owner_rolls_back_on_the_sum_of_outcomes_no_front_end_would_alone() -> None:
    clock = FakeClock()
    owner, owner_prom = front_end(CANARY_TABLE, clock, follower=False)
    follower, follower_prom = front_end(CANARY_TABLE, clock, follower=True)
    fail_canary(owner, clock, 6)  # 6 failed canary calls each: under min_requests = 10 alone
    fail_canary(follower, clock, 6)
    owner.tick()
    assert state(owner) == "active" and state(follower) == "active"  # nobody judges alone
    owner.absorb(follower.take_outcomes())
    clock.advance(1.0)
    owner.tick()
    assert state(owner) == "rolled_back"
    follower.merge(owner.shared())
    assert state(follower) == "rolled_back"
    assert {follower.choose("m", None, no_header) for _ in range(100)} == {1}
    assert {owner.choose("m", None, no_header) for _ in range(100)} == {1}
    (event,) = follower.statistics().history
    assert event.event == "rolled_back" and "canary error ratio 1.000" in event.reason
    assert follower_prom.get_sample_value("inferd_traffic_weight", {"model": "m", "version": "2"}) == 0.0
    # counted once, where it was judged
    assert owner_prom.get_sample_value("inferd_traffic_rollbacks_total", {"model": "m"}) == 1
    assert follower_prom.get_sample_value("inferd_traffic_rollbacks_total", {"model": "m"}) is None


def test_a_follower_neither_judges_nor_steps_and_sends_each_outcome_once() -> None:
    clock = FakeClock()
    follower, _ = front_end(CANARY_TABLE, clock, follower=True)
    fail_canary(follower, clock, 50)  # would roll back any judge
    assert state(follower) == "active"
    taken = follower.take_outcomes()
    assert set(taken) == {"m"} and len(taken["m"].outcomes) == 100
    assert {o for _, o, _ in taken["m"].outcomes} == {"ok", "model_error"}
    assert follower.take_outcomes() == {}
    stepping, _ = front_end(STEPS, clock, follower=True)
    clock.advance(600)
    stepping.choose("m", None, no_header)
    assert stepping.statistics().splits[0].step == 0


def test_followers_take_the_owners_steps_and_promotion() -> None:
    clock = FakeClock()
    owner, _ = front_end(STEPS, clock, follower=False)
    follower, _ = front_end(STEPS, clock, follower=True)
    clock.advance(61)
    owner.tick()
    follower.merge(owner.shared())
    assert follower.statistics().splits[0].weights == {1: 0.5, 2: 0.5}
    clock.advance(60)
    owner.tick()
    follower.merge(owner.shared())
    assert owner.registry.default_version("m") == 2 and follower.registry.default_version("m") == 2
    assert [e.event for e in follower.statistics().history] == ["step", "promoted"]


def test_a_restarted_owner_takes_a_followers_further_state_and_nothing_goes_back() -> None:
    clock = FakeClock()
    follower, _ = front_end(STEPS, clock, follower=True)
    follower.merge({"m": SplitState(follower.splits["m"].key, 1, "active")})  # the old owner's step
    clock.advance(1000)
    owner, _ = front_end(STEPS, clock, follower=False)  # restarted: at its first step
    owner.merge(follower.shared())
    assert owner.statistics().splits[0].step == 1
    clock.advance(30)
    owner.tick()
    assert owner.statistics().splits[0].step == 1  # its next step a full interval after it took step 1
    clock.advance(31)
    owner.tick()
    assert owner.registry.default_version("m") == 2
    follower.merge({"m": SplitState(follower.splits["m"].key, 0, "active")})  # older: ignored
    assert follower.statistics().splits[0].step == 1
    follower.merge({"m": SplitState("another-config", 2, "promoted")})  # another config: ignored
    assert follower.registry.default_version("m") == 1


def test_outcomes_of_another_config_are_not_judged() -> None:
    clock = FakeClock()
    owner, _ = front_end(CANARY_TABLE, clock, follower=False)
    follower, _ = front_end(CANARY_TABLE, clock, follower=True)
    fail_canary(follower, clock, 30)
    sent = follower.take_outcomes()["m"]
    owner.absorb({"m": Outcomes("another-config", sent.outcomes)})
    clock.advance(1.0)
    owner.tick()
    assert state(owner) == "active"
    owner.absorb({"m": sent})
    clock.advance(1.0)
    owner.tick()
    assert state(owner) == "rolled_back"


# ---- through the shared store (gateway/canary_share.py) ---------------------------------------------
class Flaky(MemoryStore):
    """A MemoryStore whose writes of one document fail as a store that does not answer."""

    refuse: str | None = None

    async def write(self, doc: str, body: bytes, **kw: Any) -> int:
        if doc == self.refuse:
            raise StoreUnavailable(f"writes of {doc} refused by the test")
        return await super().write(doc, body, **kw)


class Site:
    """One front end: its splits, its follow loop and its canary share; `absorbed` counts the outcomes its
    judge took from the store."""

    def __init__(self, store: MemoryStore, clock: FakeClock, name: str, table: dict[str, Any]) -> None:
        self.store = store
        self.name = name
        self.traffic, self.prom = front_end(table, clock, follower=True)
        self.follower = Follower(store, clock)
        self.grant: Grant | None = None
        self.share = CanaryShare(store, self.follower, self.traffic, name, lambda: self.grant, clock)
        self.absorbed = 0
        absorb = self.traffic.absorb

        def counting(outcomes: dict[str, Outcomes]) -> None:
            self.absorbed += sum(len(o.outcomes) for o in outcomes.values())
            absorb(outcomes)

        self.traffic.absorb = counting  # type: ignore[method-assign]

    async def hold(self) -> None:
        self.grant = await self.store.acquire("decider", self.name, 5.0)
        assert self.grant is not None

    async def leave(self) -> None:
        assert self.grant is not None
        await self.store.release(self.grant)
        self.grant = None


async def test_the_holder_rolls_back_on_every_front_ends_outcomes_through_the_store() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a, b = Site(store, clock, "a", CANARY_TABLE), Site(store, clock, "b", CANARY_TABLE)
    await a.hold()
    await a.share.step()
    assert a.traffic.follower is False and b.traffic.follower is True
    fail_canary(a.traffic, clock, 6)  # 6 failed canary calls each: under min_requests = 10 alone
    fail_canary(b.traffic, clock, 6)
    await b.share.step()  # hands its outcomes over
    assert [batch.seq for batch in b.share.pending] == [1]
    await a.hold()
    await a.share.step()
    assert a.absorbed == 12 and state(a.traffic) == "active"  # its judge looks once a second
    clock.advance(1.0)
    await a.hold()
    await a.share.step()
    assert state(a.traffic) == "rolled_back" and state(b.traffic) == "active"
    assert await b.follower.read_all()
    assert state(b.traffic) == "rolled_back"
    assert b.share.pending == []  # marked absorbed: never sent again
    assert {b.traffic.choose("m", None, no_header) for _ in range(100)} == {1}
    (event,) = b.traffic.statistics().history
    assert event.event == "rolled_back" and "canary error ratio 1.000" in event.reason
    assert a.prom.get_sample_value("inferd_traffic_rollbacks_total", {"model": "m"}) == 1
    assert b.prom.get_sample_value("inferd_traffic_rollbacks_total", {"model": "m"}) is None
    await a.hold()
    await a.share.step()
    assert a.absorbed == 12  # nothing taken twice


async def test_a_new_holder_goes_on_from_the_canary_document_never_from_the_first_step() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a = Site(store, clock, "a", STEPS)
    await a.hold()
    await a.share.step()
    clock.advance(61)
    await a.hold()
    await a.share.step()
    _, doc = await CANARY_DOC.read(store)
    assert doc.states["m"].step == 1
    clock.advance(1000)
    b = Site(store, clock, "b", STEPS)  # started (again) later: at its config's first step
    await b.share.open()
    assert b.traffic.statistics().splits[0].step == 1
    await a.leave()
    await a.share.step()
    assert a.traffic.follower is True
    await b.hold()
    await b.share.step()
    assert b.traffic.follower is False and b.traffic.statistics().splits[0].step == 1
    clock.advance(30)
    await b.hold()
    await b.share.step()
    assert b.traffic.statistics().splits[0].step == 1  # its next step a full interval after it took step 1
    clock.advance(31)
    await b.hold()
    await b.share.step()
    assert b.traffic.registry.default_version("m") == 2
    assert await a.follower.read_all()
    assert a.traffic.registry.default_version("m") == 2
    assert [e.event for e in a.traffic.statistics().history] == ["step", "promoted"]


async def test_a_front_end_that_starts_takes_the_servers_state_and_never_an_older_one() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    site = Site(store, clock, "a", STEPS)
    key = site.traffic.splits["m"].key
    await store.write(CANARY, CANARY_DOC.encode(CanaryDoc({"m": SplitState(key, 1, "active")})))
    await site.share.open()
    assert site.traffic.statistics().splits[0].step == 1
    await store.write(CANARY, CANARY_DOC.encode(CanaryDoc({"m": SplitState(key, 0, "active")})))
    await site.follower.read_all()
    assert site.traffic.statistics().splits[0].step == 1  # older: ignored
    await store.write(CANARY, CANARY_DOC.encode(CanaryDoc({"m": SplitState("another-config", 2, "promoted")})))
    await site.follower.read_all()
    assert site.traffic.registry.default_version("m") == 1  # another config: ignored


async def test_each_outcome_is_judged_once_when_the_holders_write_fails_and_when_the_holder_changes() -> None:
    clock = FakeClock()
    store = Flaky(clock)
    a, b, c = (Site(store, clock, name, CANARY_TABLE) for name in "abc")
    await a.hold()
    await a.share.step()
    fail_canary(b.traffic, clock, 2)
    await b.share.step()
    store.refuse = CANARY
    with pytest.raises(StoreUnavailable):
        await a.share.step()  # absorbed, but the marks are not written
    assert a.absorbed == 4
    store.refuse = None
    await a.share.step()
    assert a.absorbed == 4  # the holder remembers what it absorbed
    _, doc = await CANARY_DOC.read(store)
    assert doc.absorbed["b"] == Mark(b.share.incarnation, 1)
    await b.follower.read_all()
    assert b.share.pending == []
    fail_canary(b.traffic, clock, 2)
    await b.share.step()
    store.refuse = CANARY
    with pytest.raises(StoreUnavailable):
        await a.share.step()
    assert a.absorbed == 8
    await a.leave()  # a goes before its marks landed: c goes on from the document's
    store.refuse = None
    await c.hold()
    await c.share.step()
    assert c.absorbed == 4  # batch 2 only: batch 1 was marked absorbed
    await c.share.step()
    assert c.absorbed == 4
    await b.follower.read_all()
    assert b.share.pending == []


async def test_a_front_end_whose_write_fails_hands_its_outcomes_over_with_its_next_write() -> None:
    clock = FakeClock()
    store = Flaky(clock)
    a, b = Site(store, clock, "a", CANARY_TABLE), Site(store, clock, "b", CANARY_TABLE)
    await a.hold()
    store.refuse = OUTCOMES_PREFIX + "b"
    fail_canary(b.traffic, clock, 2)
    with pytest.raises(StoreUnavailable):
        await b.share.step()
    await a.share.step()
    assert a.absorbed == 0
    store.refuse = None
    fail_canary(b.traffic, clock, 1)
    await b.share.step()
    _, sent = OUTCOMES_DOC.decode(await store.read(OUTCOMES_PREFIX + "b"))
    assert [batch.seq for batch in sent.batches] == [1, 2]
    await a.share.step()
    assert a.absorbed == 6


async def test_a_front_end_that_could_not_hand_over_for_the_ttl_drops_what_it_sent_and_starts_anew() -> None:
    clock = FakeClock()
    store = Flaky(clock)
    a, b = Site(store, clock, "a", CANARY_TABLE), Site(store, clock, "b", CANARY_TABLE)
    fail_canary(b.traffic, clock, 1)
    await b.share.step()  # batch 1 landed: it may be absorbed any time
    first = b.share.incarnation
    store.refuse = OUTCOMES_PREFIX + "b"
    clock.advance(canary_share.OUTCOMES_TTL_S)
    fail_canary(b.traffic, clock, 1)
    with pytest.raises(StoreUnavailable):
        await b.share.step()  # its document has expired, and with it the mark the holder kept
    assert b.share.incarnation != first
    assert [batch.seq for batch in b.share.pending] == [1]  # batch 2, never sent, numbered anew
    store.refuse = None
    await b.share.step()
    await a.hold()
    await a.share.step()
    assert a.absorbed == 2


async def test_a_deposed_holders_late_write_is_fenced_and_it_stops_judging() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    a, c = Site(store, clock, "a", STEPS), Site(store, clock, "c", STEPS)
    await a.hold()
    await a.share.step()
    clock.advance(61)  # a's lease expired; its keeper has not said so yet (a.grant is stale)
    await c.hold()
    with pytest.raises(Fenced):
        await a.share.step()
    assert a.traffic.follower is True
    await a.share.step()  # the same stale grant: it follows, and writes nothing
    assert a.traffic.follower is True
    await c.share.step()
    _, doc = await CANARY_DOC.read(store)
    assert doc.states["m"].step == 1


async def test_pending_outcomes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(canary_share, "MAX_SAMPLES", 10)
    clock = FakeClock()
    store = Flaky(clock)
    b = Site(store, clock, "b", CANARY_TABLE)
    store.refuse = OUTCOMES_PREFIX + "b"
    for _ in range(5):
        fail_canary(b.traffic, clock, 2)
        with pytest.raises(StoreUnavailable):
            await b.share.step()
    held = sum(len(o.outcomes) for batch in b.share.pending for o in batch.outcomes.values())
    assert held == 8 and [batch.seq for batch in b.share.pending] == [4, 5]  # the oldest went first


def test_the_documents_survive_the_store() -> None:
    doc = CanaryDoc({"m": SplitState("k", 2, "rolled_back", "why")}, {"b": Mark("i", 3)})
    assert CANARY_DOC.decode(Versioned(1, CANARY_DOC.encode(doc)))[1] == doc
    sent = OutcomesDoc("i", [Batch(3, {"m": Outcomes("k", [(2, "ok", 0.5)])})])
    assert OUTCOMES_DOC.decode(Versioned(1, OUTCOMES_DOC.encode(sent)))[1] == sent


async def test_a_holder_without_splits_clears_the_states_left_and_then_writes_nothing() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    site = Site(store, clock, "a", {})  # a reload removed the split: no canary here now
    assert site.traffic.splits == {}
    await store.write(CANARY, CANARY_DOC.encode(CanaryDoc({"m": SplitState("k", 1, "rolled_back", "why")})))
    await site.follower.read_all()
    await site.hold()
    await site.share.step()
    revision, doc = await CANARY_DOC.read(store)
    assert doc.states == {}  # a split of that config added again starts afresh
    await site.share.step()
    await site.share.step()
    assert (await CANARY_DOC.read(store))[0] == revision
