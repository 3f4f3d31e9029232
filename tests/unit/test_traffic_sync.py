"""One canary decision for several front ends (gateway/traffic_control.py follower mode,
frontends/traffic_sync.py): the owner judges the sum of every front end's outcomes, steps on its clock,
and every front end applies its state; a restarted owner takes the followers' state; the exchange runs
over the plan's Unix socket."""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from inferd.clock import FakeClock
from inferd.frontends.plan import FrontendPlan
from inferd.frontends.traffic_sync import Exchange, TrafficSync, decode, encode
from inferd.gateway.traffic import SplitState
from inferd.gateway.traffic_control import Outcomes, Traffic
from inferd.observability.traffic_metrics import TrafficMetrics
from inferd.runtime.registry import ModelRegistry
from tests.unit.test_traffic import Served, configs, no_header

ROLLBACK = {"max_error_ratio": 0.5, "short_window_s": 10, "long_window_s": 30, "min_requests": 10}
CANARY = {"canary": {"version": 2, "weight": 0.5}, "rollback": ROLLBACK}
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
    owner, owner_prom = front_end(CANARY, clock, follower=False)
    follower, follower_prom = front_end(CANARY, clock, follower=True)
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
    follower, _ = front_end(CANARY, clock, follower=True)
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
    owner, _ = front_end(CANARY, clock, follower=False)
    follower, _ = front_end(CANARY, clock, follower=True)
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


def test_an_exchange_message_survives_the_wire() -> None:
    message = Exchange(
        {"m": SplitState("k", 2, "rolled_back", "why")}, {"m": Outcomes("k", [(2, "ok", 0.5)])}
    )
    assert decode(encode(message)) == message


@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="inferd-sync-")  # short: a Unix socket path has ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_a_follower_exchanges_with_the_owner_over_the_plans_socket(socket_dir: str) -> None:
    clock = FakeClock()
    plan = FrontendPlan(0, 2, socket_dir, "token")
    owner, _ = front_end(CANARY, clock, follower=False)
    follower, _ = front_end(CANARY, clock, follower=True)
    owner_sync, follower_sync = TrafficSync(plan, owner), TrafficSync(plan.at(1), follower)
    assert await follower_sync.exchange() is False  # no owner yet: the follower keeps its state
    fail_canary(owner, clock, 6)
    fail_canary(follower, clock, 6)
    await owner_sync.open()
    running = asyncio.create_task(owner_sync.run())
    try:
        assert await follower_sync.exchange() is True
        assert state(owner) == "active"  # its judge looked before the outcomes came (once a second)
        clock.advance(1.0)
        owner.tick()
        assert state(owner) == "rolled_back"
        assert await follower_sync.exchange() is True
        assert state(follower) == "rolled_back"
    finally:
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
