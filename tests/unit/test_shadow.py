"""Shadow copies: the sampler takes exactly its fraction, the budget drops copies over it, outputs are
compared (same / different / error / dropped), and no copy task outlives `close()`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferd.config import ModelConfig
from inferd.config.traffic import Shadow, TrafficConfig
from inferd.errors import Overloaded
from inferd.gateway.shadow import ShadowBudget, Shadows, ShadowSampler, same_outputs
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.runtime.registry import ModelRegistry


@given(st.floats(min_value=0.01, max_value=1.0), st.integers(min_value=1, max_value=500))
def test_sampler_takes_its_fraction_of_any_run_of_requests(fraction: float, n: int) -> None:
    sampler = ShadowSampler(fraction)
    taken = sum(sampler.sample() for _ in range(n))
    assert abs(taken - fraction * n) <= 1.0


def test_sampler_is_deterministic_and_spreads_its_copies() -> None:
    sampler = ShadowSampler(0.2)
    picks = [sampler.sample() for _ in range(10)]
    assert picks == [False, False, False, False, True] * 2
    again = ShadowSampler(0.2)
    assert [again.sample() for _ in range(10)] == picks
    every = ShadowSampler(1.0)
    assert all(every.sample() for _ in range(10))
    with pytest.raises(ValueError):
        ShadowSampler(0.0)


def test_budget_bounds_copies_in_flight() -> None:
    budget = ShadowBudget(2)
    assert budget.try_acquire() and budget.try_acquire()
    assert not budget.try_acquire()
    budget.release()
    assert budget.try_acquire()
    assert ShadowBudget(0).try_acquire() is False
    with pytest.raises(RuntimeError):
        ShadowBudget(1).release()


def test_outputs_compare_value_by_value() -> None:
    a = [{"OUT": np.array([1.0, 2.0]), "TEXT": b"x"}]
    assert same_outputs(a, [{"OUT": np.array([1.0, 2.0]), "TEXT": b"x"}])
    assert not same_outputs(a, [{"OUT": np.array([1.0, 2.5]), "TEXT": b"x"}])
    assert not same_outputs(a, [{"OUT": np.array([1.0, 2.0]), "TEXT": b"y"}])
    assert not same_outputs(a, [{"OUT": np.array([1.0, 2.0])}])
    assert not same_outputs(a, a + a)


@dataclass
class FakeRuntime:
    config: ModelConfig

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def version(self) -> int:
        return self.config.version


def served(fraction: float = 1.0) -> tuple[ModelRegistry, FakeRuntime, FakeRuntime]:
    traffic = TrafficConfig(shadow=Shadow(version=2, fraction=fraction))
    v1 = FakeRuntime(sim_config("sim", version=1, default_version=1, traffic=traffic))
    v2 = FakeRuntime(sim_config("sim", version=2))
    registry = ModelRegistry()
    registry.add(v1)  # type: ignore[arg-type]
    registry.add(v2)  # type: ignore[arg-type]
    return registry, v1, v2


def counts(metrics: Metrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in metrics.shadow_requests.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                assert s.labels["model"] == "sim" and s.labels["version"] == "2"
                out[s.labels["result"]] = s.value
    return out


def test_target_is_the_shadow_version_sampled_and_never_the_version_that_answered() -> None:
    registry, v1, v2 = served(fraction=0.5)
    shadows = Shadows(registry, Metrics().shadow_requests)
    picks = [shadows.target(v1) for _ in range(4)]  # type: ignore[arg-type]
    assert picks == [None, v2, None, v2]
    assert shadows.target(v2) is None  # type: ignore[arg-type]
    registry.remove("sim", 2)
    assert all(shadows.target(v1) is None for _ in range(4))  # type: ignore[arg-type]


async def test_copies_are_compared_counted_and_bounded_by_the_budget() -> None:
    registry, _, v2 = served()
    metrics = Metrics()
    shadows = Shadows(registry, metrics.shadow_requests, max_in_flight=2)
    release = asyncio.Event()
    answers: list[Any] = [[{"OUT": b"a"}], [{"OUT": b"b"}], Overloaded("shed", 1.0, reason="queue_full")]

    async def run(rt: Any, timeout_s: float) -> list[dict[str, Any]]:
        assert rt is v2 and timeout_s == shadows.timeout_s
        await release.wait()
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    primary = [{"OUT": b"a"}]
    shadows.mirror(v2, primary, run)  # type: ignore[arg-type]
    shadows.mirror(v2, primary, run)  # type: ignore[arg-type]
    shadows.mirror(v2, primary, run)  # type: ignore[arg-type]  # over the budget of 2
    assert shadows.in_flight == 2 and counts(metrics) == {"dropped": 1.0}
    release.set()
    await shadows.settle()
    assert counts(metrics) == {"dropped": 1.0, "same": 1.0, "different": 1.0}
    shadows.mirror(v2, primary, run)  # type: ignore[arg-type]  # the budget is free again
    await shadows.settle()
    assert counts(metrics)["error"] == 1.0
    assert shadows.budget.in_flight == 0


async def test_close_cancels_every_copy_and_frees_the_budget() -> None:
    registry, v1, v2 = served()
    shadows = Shadows(registry, Metrics().shadow_requests, max_in_flight=4)

    async def hang(rt: Any, timeout_s: float) -> list[dict[str, Any]]:
        await asyncio.Event().wait()
        return []

    for _ in range(3):
        shadows.mirror(v2, [], hang)  # type: ignore[arg-type]
    await asyncio.sleep(0)  # the copies have started and wait
    assert shadows.in_flight == 3
    await shadows.close()
    assert shadows.in_flight == 0 and shadows.budget.in_flight == 0
    assert shadows.target(v1) is None  # type: ignore[arg-type]  # closed: no new copies
