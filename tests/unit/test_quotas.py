"""The quota policy on a fake clock, its headers, the start-up check, and the engine over the in-process
store (fail open / fail closed with a store that is down)."""

from __future__ import annotations

import logging

import pytest

from inferd.clock import FakeClock
from inferd.config import ConfigError
from inferd.config.tenants import TenantConfig
from inferd.core.tenant import Tenant
from inferd.errors import Overloaded
from inferd.gateway.quota_store import (
    InProcessStore,
    QuotaSettings,
    Step,
    StoreUnavailable,
    T,
    TenantQuotas,
)
from inferd.gateway.quotas import QuotaPolicy, QuotaState, check_quota_config, format_reset
from inferd.gateway.redis_store import open_quota_store

NOW = 1000.0


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.02, "20ms"),
        (0.0201, "21ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (59.999, "59.999s"),
        (360, "6m0s"),
        (61.25, "1m1.25s"),
        (3723, "1h2m3s"),
        (-1, "0s"),
    ],
)
def test_reset_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_burst_then_one_request_per_interval() -> None:
    policy = QuotaPolicy(TenantConfig(requests_per_s=2.0, burst=3))
    state = QuotaState()
    for i in range(3):
        decision, state = policy.admit(state, NOW, f"r{i}")
        assert decision.allowed
    refused, state = policy.admit(state, NOW, "r3")
    assert not refused.allowed and refused.refused_by == ("requests",)
    assert refused.retry_after_s == pytest.approx(0.5, abs=0.002)
    assert refused.headers() == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1.5s",
    }
    assert not policy.admit(state, NOW + 0.49, "r3")[0].allowed
    assert policy.admit(state, NOW + refused.retry_after_s, "r3")[0].allowed


def test_burst_defaults_to_one_seconds_worth() -> None:
    policy = QuotaPolicy(TenantConfig(requests_per_s=4.0))
    state, admitted = QuotaState(), 0
    for i in range(10):
        decision, state = policy.admit(state, NOW, f"r{i}")
        admitted += decision.allowed
    assert admitted == 4


def test_tokens_reserved_at_admission_and_the_unused_part_refunded() -> None:
    policy = QuotaPolicy(TenantConfig(tokens_per_min=1000))
    first, state = policy.admit(QuotaState(), NOW, "a", tokens=600)
    assert first.allowed and first.grant is not None and first.grant.tokens == 600
    assert first.tokens is not None and first.tokens.remaining == 400
    refused, state = policy.admit(state, NOW + 1, "b", tokens=500)
    assert not refused.allowed and refused.refused_by == ("tokens",)
    assert refused.retry_after_s == pytest.approx(60.0, abs=0.002)  # when the 600 leave the window
    state = policy.release(state, NOW + 2, first.grant, used_tokens=100)
    again, state = policy.admit(state, NOW + 2, "b", tokens=500)
    assert again.allowed and again.tokens is not None and again.tokens.remaining == 400
    assert again.headers()["x-ratelimit-limit-tokens"] == "1000"


def test_releasing_twice_refunds_once() -> None:
    policy = QuotaPolicy(TenantConfig(tokens_per_min=1000))
    first, state = policy.admit(QuotaState(), NOW, "a", tokens=500)
    second, state = policy.admit(state, NOW, "b", tokens=500)
    assert first.grant is not None and second.grant is not None
    state = policy.release(state, NOW, first.grant, used_tokens=0)
    state = policy.release(state, NOW, first.grant, used_tokens=0)
    assert policy.admit(state, NOW, "c", tokens=500)[0].allowed
    assert not policy.admit(state, NOW, "c", tokens=501)[0].allowed


def test_a_request_over_tokens_per_min_can_never_be_admitted() -> None:
    policy = QuotaPolicy(TenantConfig(tokens_per_min=1000))
    decision, _ = policy.admit(QuotaState(), NOW, "a", tokens=1001)
    assert not decision.allowed and decision.retry_after_s is None and decision.refused_by == ("tokens",)


def test_routes_without_tokens_do_not_touch_the_tokens_window() -> None:
    policy = QuotaPolicy(TenantConfig(tokens_per_min=10))
    decision, _ = policy.admit(QuotaState(), NOW, "a")
    assert decision.allowed and decision.tokens is not None and decision.tokens.remaining == 10


def test_concurrency_is_released_and_a_lost_lease_expires() -> None:
    policy = QuotaPolicy(TenantConfig(max_concurrency=2), lease_s=30.0)
    a, state = policy.admit(QuotaState(), NOW, "a")
    _, state = policy.admit(state, NOW + 1, "b")
    refused, state = policy.admit(state, NOW + 2, "c")
    assert not refused.allowed and refused.refused_by == ("concurrency",)
    assert refused.retry_after_s == pytest.approx(28.0, abs=0.002)  # a's lease expires at NOW + 30
    assert a.grant is not None
    released = policy.release(state, NOW + 2, a.grant, used_tokens=None)
    assert policy.admit(released, NOW + 2, "c")[0].allowed
    assert policy.admit(state, NOW + 2 + refused.retry_after_s, "c")[0].allowed


def test_refused_by_several_limits_waits_for_the_longest() -> None:
    policy = QuotaPolicy(TenantConfig(requests_per_s=1.0, burst=1, tokens_per_min=100))
    _, state = policy.admit(QuotaState(), NOW, "a", tokens=100)
    refused, _ = policy.admit(state, NOW, "b", tokens=10)
    assert set(refused.refused_by) == {"requests", "tokens"}
    assert refused.retry_after_s == pytest.approx(61.0, abs=0.002)


def test_time_never_goes_back_for_a_state() -> None:
    policy = QuotaPolicy(TenantConfig(requests_per_s=1.0, burst=1))
    first, state = policy.admit(QuotaState(), NOW, "a")
    earlier, _ = policy.admit(state, NOW - 5, "b")
    assert not earlier.allowed and earlier.at_s == first.at_s
    assert earlier.retry_after_s == pytest.approx(1.0, abs=0.002)


def test_state_survives_encoding() -> None:
    policy = QuotaPolicy(TenantConfig(requests_per_s=5.0, tokens_per_min=1000, max_concurrency=3))
    _, state = policy.admit(QuotaState(), NOW, "a", tokens=10)
    _, state = policy.admit(state, NOW + 1.5, "b", tokens=20)
    assert QuotaState.decode(state.encode()) == state
    assert QuotaState.decode(None) == QuotaState()


def test_tenant_without_limits_has_no_headers() -> None:
    decision, _ = QuotaPolicy(TenantConfig()).admit(QuotaState(), NOW, "a", tokens=10**9)
    assert decision.allowed and decision.headers() == {}


def test_tokens_per_min_below_the_longest_request_is_a_config_error() -> None:
    tenants = {"acme": TenantConfig(tokens_per_min=4000), "big": TenantConfig(tokens_per_min=9000)}
    with pytest.raises(ConfigError) as err:
        check_quota_config(tenants, longest_request_tokens=8192)
    message = str(err.value)
    assert "[tenants.acme] tokens_per_min = 4000" in message and "big" not in message
    assert "raise tokens_per_min to at least 8192" in message
    check_quota_config({**tenants, "free": TenantConfig()}, longest_request_tokens=4000)


class DownStore:
    """A store that cannot be reached until `up` is set."""

    def __init__(self, clock: FakeClock) -> None:
        self.inner = InProcessStore(clock)
        self.up = False

    async def update(self, key: str, step: Step[T], keep_s: float) -> T:
        if not self.up:
            raise StoreUnavailable("connection refused")
        return await self.inner.update(key, step, keep_s)

    async def close(self) -> None:
        await self.inner.close()


LIMITED = Tenant("acme", TenantConfig(requests_per_s=1.0, burst=1, tokens_per_min=100, max_concurrency=1))


async def test_engine_admits_refuses_and_releases_through_the_store() -> None:
    clock = FakeClock()
    quotas = TenantQuotas(InProcessStore(clock), QuotaSettings(), clock)
    first = await quotas.admit(LIMITED, tokens=80)
    assert first.allowed and first.grant is not None
    refused = await quotas.admit(LIMITED, tokens=30)
    assert not refused.allowed and set(refused.refused_by) == {"requests", "tokens", "concurrency"}
    await quotas.release(LIMITED, first.grant, used_tokens=5)
    clock.advance(1.0)
    assert (await quotas.admit(LIMITED, tokens=90)).allowed
    stats = quotas.statistics()
    assert (stats.admitted, stats.refused, stats.store_errors) == (2, 1, 0)


async def test_unlimited_tenant_never_reaches_the_store() -> None:
    clock = FakeClock()
    store = DownStore(clock)
    quotas = TenantQuotas(store, QuotaSettings(on_store_error="closed"), clock)
    decision = await quotas.admit(Tenant("free", TenantConfig()), tokens=10)
    assert decision.allowed and quotas.statistics().store_errors == 0


async def test_store_down_fails_open_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    store = DownStore(clock)
    quotas = TenantQuotas(store, QuotaSettings(on_store_error="open"), clock)
    with caplog.at_level(logging.WARNING, logger="inferd.gateway.quota_store"):
        for _ in range(3):
            decision = await quotas.admit(LIMITED, tokens=100)
            assert decision.allowed and decision.grant is not None
            await quotas.release(LIMITED, decision.grant, used_tokens=100)
        assert caplog.text.count("quota store unreachable") == 1
        assert "admitted without quotas" in caplog.text
        stats = quotas.statistics()
        assert (stats.admitted_without_store, stats.store_errors, stats.store_up) == (3, 3, False)
        store.up = True
        assert (await quotas.admit(LIMITED, tokens=100)).allowed
        assert not (await quotas.admit(LIMITED, tokens=1)).allowed
        assert "reachable again" in caplog.text and quotas.statistics().store_up


async def test_store_down_fails_closed_with_a_retryable_overloaded() -> None:
    clock = FakeClock()
    quotas = TenantQuotas(DownStore(clock), QuotaSettings(on_store_error="closed"), clock)
    with pytest.raises(Overloaded, match="quota store unreachable") as err:
        await quotas.admit(LIMITED, tokens=1)
    assert err.value.retryable and err.value.retry_after_s > 0


def test_without_redis_url_the_store_is_in_process() -> None:
    assert isinstance(open_quota_store(QuotaSettings(), FakeClock()), InProcessStore)


async def test_release_reaches_the_store_only_for_a_grant_it_holds() -> None:
    clock = FakeClock()
    store = DownStore(clock)
    store.up = True
    quotas = TenantQuotas(store, QuotaSettings(), clock)
    rate_only = Tenant("rate", TenantConfig(requests_per_s=5.0))
    decision = await quotas.admit(rate_only, tokens=10)
    assert decision.grant is not None and not decision.grant.held
    store.up = False
    await quotas.release(rate_only, decision.grant, used_tokens=1)
    assert quotas.statistics().store_errors == 0
    store.up = True
    held = await quotas.admit(LIMITED, tokens=10)
    assert held.grant is not None and held.grant.held
    store.up = False
    await quotas.release(LIMITED, held.grant, used_tokens=1)
    assert quotas.statistics().store_errors == 1
