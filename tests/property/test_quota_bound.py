"""The quota policy's promises, on random tenants and random sequences of admissions, releases (with
random refunds) and clock moves:

* in any 60 s interval, the tokens granted (net of refunds) stay within tokens_per_min (the promise is
  tokens_per_min + one request's max_tokens; the sliding window keeps the tighter bound);
* in any interval of length d, at most burst + d x requests_per_s requests are admitted;
* requests in flight never exceed max_concurrency;
* a refused request has retry_after_s > 0, is admitted when retried that much later with nothing else
  changed, and would still be refused 2 ms earlier (the wait is honest, not padded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.clock import FakeClock
from inferd.config.tenants import TenantConfig
from inferd.gateway.quotas import Grant, QuotaPolicy, QuotaState

MAX_REQUEST = 2000
LEASE_S = 120.0
WINDOW_US = 60_000_000


@dataclass
class Admitted:
    at_us: int
    grant: Grant
    net: int
    released: bool = False


limits = st.builds(
    TenantConfig,
    requests_per_s=st.none() | st.floats(0.05, 50.0),
    burst=st.none() | st.integers(1, 10),
    tokens_per_min=st.none() | st.integers(MAX_REQUEST, 4 * MAX_REQUEST),
    max_concurrency=st.none() | st.integers(1, 4),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.integers(0, 3_000) | st.integers(0, 70_000)),
        st.tuples(st.just("admit"), st.integers(1, MAX_REQUEST)),
        st.tuples(
            st.just("release"), st.integers(0, 1000), st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0)
        ),
    ),
    min_size=20,
    max_size=150,
)


def check_refusal(
    policy: QuotaPolicy, state: QuotaState, now: float, tokens: int, retry: float | None
) -> None:
    limit = policy.limits.tokens_per_min
    if retry is None:
        assert limit is not None and tokens > limit
        return
    assert retry > 0
    assert policy.admit(state, now + retry, "retry", tokens)[0].allowed
    if retry > 0.002:
        assert not policy.admit(state, now + retry - 0.002, "early", tokens)[0].allowed


def run(config: TenantConfig, ops: list[tuple]) -> list[Admitted]:
    policy = QuotaPolicy(config, lease_s=LEASE_S)
    clock, state = FakeClock(), QuotaState()
    admitted: list[Admitted] = []
    for n, op in enumerate(ops):
        if op[0] == "advance":
            clock.advance_ms(op[1])
        elif op[0] == "admit":
            tokens = op[1]
            decision, state = policy.admit(state, clock.now(), f"l{n}", tokens)
            if not decision.allowed:
                check_refusal(policy, state, clock.now(), tokens, decision.retry_after_s)
                continue
            assert decision.grant is not None
            record = Admitted(round(decision.at_s * 1e6), decision.grant, decision.grant.tokens)
            admitted.append(record)
            in_flight = [a for a in admitted if not a.released and a.at_us + LEASE_S * 1e6 > record.at_us]
            assert config.max_concurrency is None or len(in_flight) <= config.max_concurrency
        else:
            open_ = [a for a in admitted if not a.released]
            if open_:
                record = open_[op[1] % len(open_)]
                used = math.floor(op[2] * record.grant.tokens)
                state = policy.release(state, clock.now(), record.grant, used)
                record.released, record.net = True, used
    return admitted


def assert_tokens_bound(config: TenantConfig, admitted: list[Admitted]) -> None:
    if config.tokens_per_min is None:
        return
    for start in admitted:
        window = sum(a.net for a in admitted if start.at_us <= a.at_us < start.at_us + WINDOW_US)
        assert window <= config.tokens_per_min  # and so <= tokens_per_min + one request, as promised


def assert_requests_bound(config: TenantConfig, admitted: list[Admitted]) -> None:
    rate = config.requests_per_s
    if rate is None:
        return
    burst = config.burst or max(1, math.ceil(rate))
    interval_us = max(1, round(1e6 / rate))
    for i, first in enumerate(admitted):
        for j in range(i, len(admitted)):
            assert j - i + 1 <= burst + (admitted[j].at_us - first.at_us) / interval_us


@settings(max_examples=300, deadline=None)
@given(limits, operations)
def test_quota_promises_hold_on_any_sequence(config: TenantConfig, ops: list[tuple]) -> None:
    admitted = run(config, ops)
    assert_tokens_bound(config, admitted)
    assert_requests_bound(config, admitted)


@settings(max_examples=300, deadline=None)
@given(st.integers(MAX_REQUEST, 3 * MAX_REQUEST), operations)
def test_tokens_bound_holds_with_any_refunds(limit: int, ops: list[tuple]) -> None:
    """Tokens alone (the other limits would refuse first and hide a tokens bug)."""
    config = TenantConfig(tokens_per_min=limit)
    assert_tokens_bound(config, run(config, ops))


@settings(max_examples=100, deadline=None)
@given(st.integers(MAX_REQUEST, 3 * MAX_REQUEST), st.lists(st.integers(1, MAX_REQUEST), max_size=200))
def test_a_steady_stream_gets_the_whole_tokens_budget_back_each_minute(limit: int, sizes: list[int]) -> None:
    """Not only safe but live: a request is refused only when the window's room left (what the
    `x-ratelimit-remaining-tokens` header says) is smaller than it."""
    policy = QuotaPolicy(TenantConfig(tokens_per_min=limit))
    clock, state = FakeClock(), QuotaState()
    for n, tokens in enumerate(sizes):
        decision, state = policy.admit(state, clock.now(), f"l{n}", tokens)
        if not decision.allowed:
            assert decision.tokens is not None and decision.tokens.remaining < tokens
        clock.advance(0.5)
