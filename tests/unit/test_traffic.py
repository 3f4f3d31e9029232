"""The server's traffic splits (gateway/traffic_control.py) over a real ModelRegistry on a FakeClock:
start-up checks, which version unversioned requests get, rollback with its metric, log and history,
promotion of a canary that reaches 1.0, and the judge's latency signal."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from inferd.clock import FakeClock
from inferd.config import ConfigError, ModelConfig
from inferd.config.traffic import Rollback
from inferd.gateway.canary_judge import CanaryJudge
from inferd.gateway.traffic_control import Traffic, check_traffic
from inferd.observability.traffic_metrics import TrafficMetrics
from inferd.runtime.registry import ModelRegistry


@dataclass
class Served:
    """What the registry and Traffic read of a runtime."""

    config: ModelConfig
    kind: str = "batch"

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def version(self) -> int:
        return self.config.version


def configs(traffic: dict[str, Any], versions: tuple[int, ...] = (1, 2)) -> list[ModelConfig]:
    return [
        ModelConfig(name="m", version=v, kind="llm", implementation="x:Y", default_version=1, traffic=traffic)
        for v in versions
    ]


def traffic_of(traffic: dict[str, Any], clock: FakeClock, seed: int = 1) -> tuple[Traffic, CollectorRegistry]:
    registry = ModelRegistry()
    for c in configs(traffic):
        registry.add(Served(c))  # type: ignore[arg-type]
    prom = CollectorRegistry()
    return Traffic(registry, clock, TrafficMetrics(prom), random.Random(seed), wall_clock=lambda: 5.0), prom


def no_header(name: bytes) -> str | None:
    return None


ROLLBACK = {"max_error_ratio": 0.1, "short_window_s": 10, "long_window_s": 30, "min_requests": 10}


def test_a_canary_or_arm_version_that_is_not_served_is_refused_naming_the_served_versions() -> None:
    with pytest.raises(ConfigError, match=r"canary version 3 is not served \(served versions: \[1, 2\]\)"):
        check_traffic(configs({"canary": {"version": 3}}))
    with pytest.raises(ConfigError, match="ab arm version 4 is not served"):
        check_traffic(configs({"ab": {"arms": {"1": 0.5, "4": 0.5}}}))
    with pytest.raises(ConfigError, match="shadow version 5 is not served"):
        check_traffic(configs({"shadow": {"version": 5}}))
    with pytest.raises(ConfigError, match="canary version 1 is the default version; set default_version"):
        check_traffic(configs({"canary": {"version": 1}}))
    check_traffic(configs({"canary": {"version": 2}}))


def test_models_without_a_split_keep_their_default() -> None:
    traffic, _ = traffic_of({}, FakeClock())
    assert traffic.choose("m", None, no_header) is None
    assert traffic.choose("other", None, no_header) is None
    assert traffic.statistics().splits == ()


def test_ab_by_tenant_and_by_header_is_sticky() -> None:
    clock = FakeClock()
    by_tenant, _ = traffic_of({"ab": {"arms": {"1": 0.5, "2": 0.5}}}, clock)
    picks = {t: by_tenant.choose("m", t, no_header) for t in ("acme", "globex", "initech", "umbrella")}
    assert all(by_tenant.choose("m", t, no_header) == v for t, v in picks.items())
    assert set(picks.values()) <= {1, 2}
    by_header, prom = traffic_of({"ab": {"arms": {"1": 0.5, "2": 0.5}, "sticky_by": "header:X-User"}}, clock)
    seen: list[bytes] = []

    def header(name: bytes) -> str | None:
        seen.append(name)
        return "alice"

    first = by_header.choose("m", None, header)
    assert all(by_header.choose("m", "any-tenant", header) == first for _ in range(20))
    assert set(seen) == {b"x-user"}  # looked up by its lower-case name
    assert (
        prom.get_sample_value("inferd_traffic_assignments_total", {"model": "m", "version": str(first)}) == 21
    )


def test_a_failing_canary_is_rolled_back_with_a_metric_a_log_line_and_a_history_entry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    traffic, prom = traffic_of({"canary": {"version": 2, "weight": 0.5}, "rollback": ROLLBACK}, clock)
    registry = traffic.registry
    v1, v2 = registry.get("m", 1), registry.get("m", 2)
    assert prom.get_sample_value("inferd_traffic_weight", {"model": "m", "version": "2"}) == 0.5
    with caplog.at_level(logging.WARNING, logger="inferd.traffic"):
        for _ in range(40):
            clock.advance(1.0)
            traffic.observe(v1, "ok", 0.01)
            traffic.observe(v2, "model_error", 0.01)
    assert prom.get_sample_value("inferd_traffic_rollbacks_total", {"model": "m"}) == 1
    assert prom.get_sample_value("inferd_traffic_weight", {"model": "m", "version": "2"}) == 0.0
    assert prom.get_sample_value("inferd_traffic_weight", {"model": "m", "version": "1"}) == 1.0
    (line,) = [r.getMessage() for r in caplog.records if "rolled back" in r.getMessage()]
    assert "canary 'm' version 2 rolled back to weight 0: canary error ratio 1.000" in line
    (event,) = traffic.statistics().history
    assert (event.model, event.version, event.event, event.at) == ("m", 2, "rolled_back", 5.0)
    assert "over the bound 0.1" in event.reason
    assert {traffic.choose("m", None, no_header) for _ in range(200)} == {1}
    clock.advance(10_000)  # it stays at 0: no recovery without a config reload
    for _ in range(40):
        clock.advance(1.0)
        traffic.observe(v2, "ok", 0.01)
    assert {traffic.choose("m", None, no_header) for _ in range(200)} == {1}
    (split,) = traffic.statistics().splits
    assert split.state == "rolled_back" and split.weights == {1: 1.0, 2: 0.0}


def test_a_short_burst_of_canary_errors_within_a_healthy_long_window_does_not_roll_back() -> None:
    clock = FakeClock()
    traffic, prom = traffic_of({"canary": {"version": 2, "weight": 0.5}, "rollback": ROLLBACK}, clock)
    v2 = traffic.registry.get("m", 2)
    for _ in range(200):  # 20 s of healthy canary traffic fills the long window
        clock.advance(0.1)
        traffic.observe(v2, "ok", 0.01)
    for _ in range(12):  # the short window breaches, the long one (12 of 212+) does not
        clock.advance(0.1)
        traffic.observe(v2, "model_error", 0.01)
    assert prom.get_sample_value("inferd_traffic_rollbacks_total", {"model": "m"}) is None
    assert traffic.statistics().splits[0].state == "active"


def test_client_errors_and_refusals_do_not_count_against_the_canary() -> None:
    clock = FakeClock()
    traffic, prom = traffic_of({"canary": {"version": 2, "weight": 0.5}, "rollback": ROLLBACK}, clock)
    v2 = traffic.registry.get("m", 2)
    for outcome in ("bad_request", "rejected", "rate_limited", "cancelled", "not_found") * 20:
        clock.advance(0.2)
        traffic.observe(v2, outcome, 0.01)
    assert prom.get_sample_value("inferd_traffic_rollbacks_total", {"model": "m"}) is None


def test_a_canary_whose_last_step_is_one_becomes_the_default_version() -> None:
    clock = FakeClock()
    steps = {"version": 2, "steps": [0.1, 0.5, 1.0], "step_interval_s": 60}
    traffic, prom = traffic_of({"canary": steps}, clock)
    assert traffic.registry.default_version("m") == 1
    clock.advance(61)
    traffic.choose("m", None, no_header)
    assert prom.get_sample_value("inferd_traffic_weight", {"model": "m", "version": "2"}) == 0.5
    clock.advance(60)
    assert traffic.choose("m", None, no_header) == 2
    assert traffic.registry.default_version("m") == 2
    assert [e.event for e in traffic.statistics().history] == ["step", "promoted"]
    assert {traffic.choose("m", None, no_header) for _ in range(50)} == {2}


def test_the_judge_rolls_back_on_p99_only_when_worse_than_the_baseline() -> None:
    clock = FakeClock()
    rollback = Rollback(max_p99_ms=100, short_window_s=5, long_window_s=20, min_requests=5)
    judge = CanaryJudge(rollback, clock)
    for _ in range(30):
        clock.advance(0.5)
        judge.record(False, "ok", 0.3)  # the baseline is just as slow: not the canary's fault
        judge.record(True, "ok", 0.25)
    assert judge.verdict() is None
    for _ in range(60):
        clock.advance(0.5)
        judge.record(False, "ok", 0.02)
        judge.record(True, "ok", 0.25)
    breach = judge.verdict()
    assert breach is not None and breach.signal == "p99_ms"
    assert "canary p99 250.0 ms" in breach.reason and "bound 100 ms" in breach.reason


def test_a_split_version_retired_since_start_sends_its_requests_to_the_default() -> None:
    clock = FakeClock()
    traffic, prom = traffic_of({"canary": {"version": 2, "weight": 1.0}}, clock)
    assert traffic.choose("m", None, no_header) == 2
    traffic.registry.remove("m", 2)  # a rolling update retired it
    assert {traffic.choose("m", None, no_header) for _ in range(20)} == {1}
    assert prom.get_sample_value("inferd_traffic_assignments_total", {"model": "m", "version": "1"}) == 20
