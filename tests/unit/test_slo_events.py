"""SLI events: what counts against availability (through the real middleware chain), latency events
at the threshold, LLM token events, histogram buckets at each threshold, and the in-process burn
windows on a fake clock."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest
from prometheus_client import CollectorRegistry

from inferd.api.asgi import HttpResponse
from inferd.api.middleware import Accounting, Errors
from inferd.clock import FakeClock
from inferd.core.call import Call, chain
from inferd.core.disconnect import STAYING
from inferd.errors import (
    BadRequest,
    DeadlineExceeded,
    Internal,
    ModelError,
    Overloaded,
    ServingError,
    WorkerUnavailable,
)
from inferd.gateway.quota_layer import QuotaExceeded
from inferd.observability.metrics import Metrics
from inferd.observability.slo_config import SloConfig
from inferd.observability.slo_window import BurnWindow


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def events(m: Metrics, model: str, slo: str) -> tuple[float, float]:
    """(good, bad) events of one SLO."""
    count = partial(sample, m.registry, "inferd_slo_events_total", model=model, slo=slo)
    return count(result="good"), count(result="bad")


@dataclass
class FakeRuntime:
    name: str
    version: int = 1


def error_body(exc: ServingError, status: int) -> bytes:
    return exc.message.encode()


async def serve(m: Metrics, clock: FakeClock, outcome: ServingError | float) -> int:
    """One request of model sim through accounting -> errors -> a handler that fails with `outcome`
    or answers after `outcome` seconds."""

    async def handler(call: Call, request: object) -> HttpResponse:
        call.runtime = FakeRuntime("sim")  # type: ignore[assignment]
        if isinstance(outcome, ServingError):
            raise outcome
        clock.advance(outcome)
        return HttpResponse(b"ok")

    path = "/v2/models/sim/infer"
    call = Call(error_body, STAYING, route=path, method="POST", target=path)
    response = await chain([partial(Accounting, metrics=m, clock=clock), Errors], handler)(call, None)
    return response.status


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics(clock: FakeClock) -> Metrics:
    return Metrics({"sim": SloConfig(latency_ms=125)}, clock)


async def test_server_failures_deadlines_and_overload_count_against_availability(
    metrics: Metrics, clock: FakeClock
) -> None:
    statuses = [
        await serve(metrics, clock, exc)
        for exc in (
            Internal("boom"),
            WorkerUnavailable("no worker"),
            DeadlineExceeded("late"),
            Overloaded("queue full", 1.0, reason="queue_full"),
        )
    ]
    assert statuses == [500, 503, 504, 429]
    assert events(metrics, "sim", "availability") == (0, 4)


async def test_quota_429s_and_client_errors_are_not_availability_events(
    metrics: Metrics, clock: FakeClock
) -> None:
    statuses = [
        await serve(metrics, clock, exc)
        for exc in (
            QuotaExceeded("tenant over its limit", 1.0, {}),
            BadRequest("bad input"),
            ModelError("cannot run on this input"),
        )
    ]
    assert statuses == [429, 400, 422]
    assert events(metrics, "sim", "availability") == (0, 0)
    assert events(metrics, "sim", "latency") == (0, 0)


async def test_a_success_is_fast_up_to_exactly_latency_ms(metrics: Metrics, clock: FakeClock) -> None:
    for latency_s in (0.0625, 0.125, 0.1875):  # exact in binary, as the clock's sums are
        assert await serve(metrics, clock, latency_s) == 200
    assert events(metrics, "sim", "availability") == (3, 0)
    assert events(metrics, "sim", "latency") == (2, 1)
    # the histogram has a bucket at exactly 125 ms (not one of the default buckets), agreeing with the events
    bucket = partial(
        sample,
        metrics.registry,
        "inferd_request_duration_seconds_bucket",
        model="sim",
        version="1",
        outcome="ok",
        protocol="http",
    )
    assert bucket(le="0.1") == 1
    assert bucket(le="0.125") == 2
    assert bucket(le="0.2") == 3


def test_models_without_an_slo_table_export_no_events(clock: FakeClock) -> None:
    m = Metrics({}, clock)
    m.slo.request("sim", "internal", None, 0.5)
    assert events(m, "sim", "availability") == (0, 0)
    assert m.slo.statistics() == ()


def test_llm_tokens_feed_the_ttft_and_itl_slos_and_their_buckets(clock: FakeClock) -> None:
    m = Metrics({"chat": SloConfig(latency_ms=5000, ttft_ms=300, itl_ms=40)}, clock)
    llm = m.for_llm("chat")
    llm.tokens(1, 0.25, first=True)  # good first token
    llm.tokens(4, 0.12, first=False)  # 30 ms apart: 4 good
    llm.tokens(2, 0.1, first=False)  # 50 ms apart: 2 bad
    llm.tokens(1, 0.5, first=True)  # a slow first token
    assert events(m, "chat", "ttft") == (1, 1)
    assert events(m, "chat", "itl") == (4, 2)
    assert events(m, "chat", "latency") == (0, 0)
    assert (
        sample(m.registry, "inferd_time_to_first_token_seconds_bucket", model="chat", version="1", le="0.3")
        == 1
    )
    assert (
        sample(m.registry, "inferd_inter_token_latency_seconds_bucket", model="chat", version="1", le="0.04")
        == 1
    )


def test_burn_rate_gauges_cover_the_last_5_and_30_minutes(metrics: Metrics, clock: FakeClock) -> None:
    burn = partial(sample, metrics.registry, "inferd_slo_burn_rate", model="sim", slo="availability")
    for _ in range(98):
        metrics.slo.request("sim", "ok", None, 0.01)
    metrics.slo.request("sim", "internal", None, 0.01)
    metrics.slo.request("sim", "internal", None, 0.01)
    assert burn(window="5m") == pytest.approx(20.0)  # 2% bad over a 0.1% budget
    assert burn(window="30m") == pytest.approx(20.0)
    clock.advance(600)
    for _ in range(100):
        metrics.slo.request("sim", "ok", None, 0.01)
    assert burn(window="5m") == 0.0  # the failures left the short window...
    assert burn(window="30m") == pytest.approx(10.0)  # ...not the long one: 2 bad in 200
    clock.advance(1800)
    assert burn(window="30m") == 0.0
    assert sample(metrics.registry, "inferd_slo_objective", model="sim", slo="availability") == 0.999
    assert sample(metrics.registry, "inferd_slo_threshold_seconds", model="sim", slo="latency") == 0.125


def test_burn_window_counts_whole_slots_and_forgets_past_its_span(clock: FakeClock) -> None:
    window = BurnWindow(clock, error_budget=0.01, span_s=60, slot_s=10)
    window.add(good=False)
    clock.advance(10)
    window.add(good=True, n=9)
    assert window.counts(10).total == 9  # only the current slot
    assert window.counts(20) == window.counts(60)
    assert window.burn_rate(60) == pytest.approx(10.0)  # 1 bad in 10, over a 1% budget
    clock.advance(55)  # the first slot is past the span
    assert (window.counts(60).good, window.counts(60).bad) == (9, 0)
    clock.advance(60)
    assert window.burn_rate(60) == 0.0
    with pytest.raises(ValueError, match="error budget"):
        BurnWindow(clock, error_budget=0.0)
