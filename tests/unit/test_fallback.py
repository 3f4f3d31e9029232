"""Fallback to another model: the breaker on a fake clock, which refusals hand a request over (never a
tenant's quota 429), one hop only, and the start-up checks of the `fallback` setting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.config import ConfigError, ModelConfig
from inferd.config.traffic import TrafficConfig
from inferd.errors import DeadlineExceeded, ModelError, Overloaded, ServingError, WorkerUnavailable
from inferd.gateway.fallback import Breaker, BreakerState, Fallbacks, check_fallbacks, falls_back
from inferd.gateway.quota_layer import QuotaExceeded
from inferd.kinds.builtin import builtin_kinds
from inferd.models.sim import sim_config
from inferd.runtime.registry import ModelRegistry

KINDS = builtin_kinds()


@dataclass
class FakeRuntime:
    config: ModelConfig
    kind: str = "batch"
    refuse: ServingError | None = None
    asked: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def version(self) -> int:
        return self.config.version

    def precheck(self) -> str:
        self.asked.append(self.name)
        if self.refuse is not None:
            raise self.refuse
        return self.name


def registry_of(*runtimes: FakeRuntime) -> ModelRegistry:
    registry = ModelRegistry()
    for rt in runtimes:
        registry.add(rt)  # type: ignore[arg-type]
    return registry


def with_fallback(name: str, fallback: str | None, **kw: Any) -> ModelConfig:
    return sim_config(name, traffic=TrafficConfig(fallback=fallback), **kw)


# ---- the breaker ------------------------------------------------------------------------------------
def test_breaker_opens_after_n_consecutive_failures_and_half_opens_after_the_cool_down() -> None:
    clock = FakeClock()
    b = Breaker(clock, failures=3, cool_down_s=5.0)
    b.failure()
    b.failure()
    b.success()  # the streak is broken
    b.failure()
    b.failure()
    assert b.state is BreakerState.CLOSED and b.allow()
    b.failure()
    assert b.state is BreakerState.OPEN
    assert not b.allow()
    clock.advance(4.999)
    assert not b.allow()
    clock.advance(0.001)
    assert b.allow() and b.state is BreakerState.HALF_OPEN  # the probe
    assert not b.allow()  # one probe per cool-down
    b.success()
    assert b.state is BreakerState.CLOSED and b.allow() and b.allow()


def test_a_failed_probe_reopens_at_once_and_a_lost_probe_does_not_wedge_it() -> None:
    clock = FakeClock()
    b = Breaker(clock, failures=2, cool_down_s=1.0)
    b.failure()
    b.failure()
    clock.advance(1.0)
    assert b.allow()
    b.failure()  # one failure in half-open is enough
    assert b.state is BreakerState.OPEN and not b.allow()
    clock.advance(1.0)
    assert b.allow()  # this probe never reports back...
    clock.advance(1.0)
    assert b.allow()  # ...and another one is let through a cool-down later


@given(st.lists(st.sampled_from(["fail", "ok", "tick"]), max_size=60))
def test_breaker_never_skips_the_primary_without_n_consecutive_failures(events: list[str]) -> None:
    clock = FakeClock()
    b = Breaker(clock, failures=3, cool_down_s=2.0)
    streak = 0
    for event in events:
        if event == "fail":
            b.failure()
            streak += 1
        elif event == "ok":
            b.success()
            streak = 0
        else:
            clock.advance(1.0)
        if streak < 3:
            assert b.allow()


def test_breaker_refuses_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        Breaker(FakeClock(), failures=0)
    with pytest.raises(ValueError):
        Breaker(FakeClock(), cool_down_s=0.0)


# ---- which refusals fall back -----------------------------------------------------------------------
def test_only_capacity_refusals_fall_back_never_a_tenant_quota() -> None:
    assert falls_back(WorkerUnavailable("no ready worker"))
    assert falls_back(Overloaded("queue full", 1.0, reason="queue_full"))
    assert falls_back(Overloaded("llm queue full", 1.0, reason="llm_queue_full"))
    assert falls_back(Overloaded("cannot meet the deadline", 1.0, reason="deadline"))
    assert not falls_back(QuotaExceeded("tenant over quota", 1.0, {}))
    assert not falls_back(Overloaded("front end saturated", 1.0, reason="front_end_saturated"))
    assert not falls_back(DeadlineExceeded("missed while running"))
    assert not falls_back(ModelError("bad input"))


def test_admit_hands_a_refused_request_to_the_fallback_and_the_breaker_skips_the_primary() -> None:
    clock = FakeClock()
    primary = FakeRuntime(with_fallback("sim", "sim-b"), refuse=WorkerUnavailable("none ready"))
    other = FakeRuntime(with_fallback("sim-b", None))
    registry = registry_of(primary, other)
    fallbacks = Fallbacks(registry, KINDS, clock, failures=2, cool_down_s=5.0)
    target = fallbacks.target(primary)  # type: ignore[arg-type]
    assert target is other
    for _ in range(2):
        rt, value = fallbacks.admit(primary, target, lambda r: r.precheck())  # type: ignore[arg-type]
        assert rt is other and value == "sim-b"
    assert primary.asked == ["sim", "sim"]
    for _ in range(5):  # open: the primary is not asked at all
        assert fallbacks.admit(primary, target, lambda r: r.precheck())[0] is other  # type: ignore[arg-type]
    assert primary.asked == ["sim", "sim"]
    primary.refuse = None
    clock.advance(5.0)
    assert fallbacks.admit(primary, target, lambda r: r.precheck())[0] is primary  # type: ignore[arg-type]
    assert fallbacks.breaker(primary)  # type: ignore[arg-type].state is BreakerState.CLOSED


def test_a_quota_refusal_is_raised_and_a_queue_429_does_not_open_the_breaker() -> None:
    clock = FakeClock()
    primary = FakeRuntime(with_fallback("sim", "sim-b"), refuse=QuotaExceeded("over quota", 1.0, {}))
    other = FakeRuntime(with_fallback("sim-b", None))
    fallbacks = Fallbacks(registry_of(primary, other), KINDS, clock, failures=1)
    with pytest.raises(QuotaExceeded):
        fallbacks.admit(primary, other, lambda r: r.precheck())  # type: ignore[arg-type]
    assert other.asked == []
    primary.refuse = Overloaded("queue full", 1.0, reason="queue_full")
    for _ in range(3):
        assert fallbacks.admit(primary, other, lambda r: r.precheck())[0] is other  # type: ignore[arg-type]
    assert fallbacks.breaker(primary)  # type: ignore[arg-type].state is BreakerState.CLOSED  # overload is per request, not an outage


def test_one_hop_only_the_fallbacks_refusal_is_raised() -> None:
    primary = FakeRuntime(with_fallback("a", "b"), refuse=WorkerUnavailable("a: none ready"))
    middle = FakeRuntime(with_fallback("b", "c"), refuse=WorkerUnavailable("b: none ready"))
    last = FakeRuntime(with_fallback("c", None))
    fallbacks = Fallbacks(registry_of(primary, middle, last), KINDS, FakeClock())
    with pytest.raises(WorkerUnavailable, match="b: none ready"):
        fallbacks.admit(primary, fallbacks.target(primary), lambda r: r.precheck())  # type: ignore[arg-type]
    assert last.asked == []


def test_the_fallback_must_serve_the_same_routes() -> None:
    primary = FakeRuntime(with_fallback("sim", "chat"))
    llm = FakeRuntime(with_fallback("chat", None), kind="llm")
    fallbacks = Fallbacks(registry_of(primary, llm), KINDS, FakeClock())
    assert fallbacks.target(primary) is None  # type: ignore[arg-type]


# ---- start-up checks --------------------------------------------------------------------------------
def kinds_of(served: dict[str, str]) -> Any:
    return lambda name: {served[name]} if name in served else set()


def test_start_up_names_an_unknown_fallback_a_wrong_kind_and_a_self_reference() -> None:
    ok = with_fallback("sim", "sim-b")
    check_fallbacks([ok], kinds_of({"sim": "batch", "sim-b": "batch"}), KINDS)
    with pytest.raises(ConfigError, match="'nope' is not a served model: serve 'nope' or remove"):
        check_fallbacks([with_fallback("sim", "nope")], kinds_of({"sim": "batch"}), KINDS)
    with pytest.raises(
        ConfigError, match=r"is a llm model, which cannot answer a batch .*name a batch model"
    ):
        check_fallbacks([with_fallback("sim", "chat")], kinds_of({"sim": "batch", "chat": "llm"}), KINDS)
    with pytest.raises(ConfigError, match="names the model itself"):
        check_fallbacks([with_fallback("sim", "sim")], kinds_of({"sim": "batch"}), KINDS)
    chat = ModelConfig(
        name="chat", kind="llm", implementation="x:Y", traffic=TrafficConfig(fallback="remote")
    )
    check_fallbacks(
        [chat], kinds_of({"chat": "llm", "remote": "upstream"}), KINDS
    )  # LLM routes: llm or upstream


def test_explicit_model_control_starts_with_a_fallback_that_is_in_the_repository_but_not_loaded(tmp_path: Any) -> None:
    """`--model-control explicit --load-model a`, a's fallback b in the repository but not loaded at start:
    the server starts (b is loadable; until it is loaded, a has no fallback to hand requests to), as a load
    of a whose fallback is not served is accepted while serving. A fallback the repository lacks is still
    refused at start."""
    from inferd.config import ServerConfig
    from inferd.server import InferenceServer

    config = ServerConfig(port=0, admin_port=None, grpc_port=None, data_dir=tmp_path / "data", model_control="explicit", load_model=("a",))
    server = InferenceServer(config, [_with_fallback("a", "b"), sim_config("b")], spawn_workers=False)
    assert server.registry.names() == ["a"]
    assert Fallbacks(server.registry, KINDS, FakeClock()).target(server.registry.get("a")) is None
    with pytest.raises(ConfigError, match="'zz' is not a served model"):
        InferenceServer(config, [_with_fallback("a", "zz"), sim_config("b")], spawn_workers=False)


def _with_fallback(name: str, fallback: str) -> ModelConfig:
    return sim_config(name, traffic=TrafficConfig(fallback=fallback))
