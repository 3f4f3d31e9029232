"""DoorPolicy: connection caps, head limits, the admission token bucket and keep-alive limits, on a fake
clock."""

from __future__ import annotations

import pytest

from inferd.api.door_policy import REPORT_EVERY_S, DoorLimits, DoorPolicy, TokenBucket
from inferd.clock import FakeClock
from inferd.config import ServerConfig
from inferd.errors import HeaderTooLarge, Overloaded, RateLimited, RequestTimeout

INFER = b"/v2/models/sim/infer"


def policy(clock: FakeClock | None = None, **limits: object) -> DoorPolicy:
    return DoorPolicy(DoorLimits(**limits), clock or FakeClock())  # type: ignore[arg-type]


def test_connections_past_the_cap_are_refused_until_one_closes() -> None:
    door = policy(max_connections=2, max_connections_per_ip=None)
    assert door.connect("10.0.0.1") is None
    assert door.connect("10.0.0.2") is None
    refusal = door.connect("10.0.0.3")
    assert isinstance(refusal, Overloaded) and refusal.reason == "connections"
    assert refusal.retry_after_s > 0 and "2 open, the limit is 2" in refusal.message
    door.disconnect("10.0.0.1")
    assert door.connect("10.0.0.3") is None
    assert door.statistics().open_connections == 2
    assert door.statistics().refused == {"connections": 1}


def test_one_address_past_its_cap_is_refused_while_others_connect() -> None:
    door = policy(max_connections=100, max_connections_per_ip=2)
    assert door.connect("a") is None and door.connect("a") is None
    refusal = door.connect("a")
    assert isinstance(refusal, Overloaded) and refusal.reason == "connections_per_ip"
    assert "from a" in refusal.message
    assert door.connect("b") is None
    assert door.statistics().busiest_address == 2
    door.disconnect("a")
    assert door.connect("a") is None


def test_a_refused_connection_is_not_counted() -> None:
    door = policy(max_connections=1)
    assert door.connect("a") is None
    for _ in range(5):
        assert door.connect("b") is not None
    door.disconnect("a")
    assert door.statistics().open_connections == 0
    assert door.statistics().busiest_address == 0


@pytest.mark.parametrize(("size", "count", "refused"), [(16, 100, False), (17, 1, True), (1, 101, True)])
def test_a_head_over_the_byte_or_line_limit_is_refused(size: int, count: int, refused: bool) -> None:
    door = policy(max_header_bytes=16, max_header_count=100)
    result = door.check_head(size, count)
    assert isinstance(result, HeaderTooLarge) if refused else result is None


def test_the_admission_rate_lets_the_burst_through_then_one_per_token() -> None:
    clock = FakeClock()
    door = policy(clock, admission_rate_per_s=10.0, admission_burst=3)
    assert [door.admit(INFER) for _ in range(3)] == [None, None, None]
    refusal = door.admit(INFER)
    assert isinstance(refusal, RateLimited)
    assert refusal.retry_after_s == pytest.approx(0.1)  # honest: one token comes in 1/rate
    clock.advance(0.05)
    late = door.admit(INFER)
    assert isinstance(late, RateLimited) and late.retry_after_s == pytest.approx(0.05)
    clock.advance(0.05)
    assert door.admit(INFER) is None
    assert door.admit(INFER) is not None
    assert door.statistics().refused == {"rate": 3}


def test_the_admission_burst_defaults_to_one_second_of_rate_and_never_grows_past_it() -> None:
    clock = FakeClock()
    door = policy(clock, admission_rate_per_s=5.0)
    clock.advance(60.0)  # idle time does not save more than the burst
    assert sum(door.admit(INFER) is None for _ in range(20)) == 5


def test_probes_and_scrapes_pass_the_admission_rate_free() -> None:
    door = policy(admission_rate_per_s=1.0, admission_burst=1)
    assert door.admit(INFER) is None and door.admit(INFER) is not None
    for target in (b"/v2/health/ready", b"/v2/health/live", b"/metrics", b"/metrics?x=1"):
        assert door.admit(target) is None


def test_no_admission_rate_admits_everything() -> None:
    door = policy()
    assert all(door.admit(INFER) is None for _ in range(10_000))


def test_a_token_bucket_needs_a_positive_rate_and_a_whole_token() -> None:
    with pytest.raises(ValueError, match="rate > 0"):
        TokenBucket(0.0, 5.0, FakeClock())
    with pytest.raises(ValueError, match="burst >= 1"):
        TokenBucket(1.0, 0.5, FakeClock())


def test_keep_alive_ends_after_the_requests_per_connection_cap() -> None:
    assert policy().keep_alive(10**9)
    door = policy(max_requests_per_connection=3)
    assert door.keep_alive(2) and not door.keep_alive(3)


def test_timeouts_are_counted_and_name_their_setting() -> None:
    door = policy(header_timeout_s=2.0, body_timeout_s=7.0)
    head, body = door.head_timed_out(), door.body_timed_out()
    assert isinstance(head, RequestTimeout) and "2 s (header_timeout_s)" in head.message
    assert isinstance(body, RequestTimeout) and "7 s (body_timeout_s)" in body.message
    assert door.statistics().refused == {"header_timeout": 1, "body_timeout": 1}


def test_refusals_are_reported_at_most_once_per_period() -> None:
    clock = FakeClock()
    door = policy(clock)
    assert door.report_due()
    assert not door.report_due()
    clock.advance(REPORT_EVERY_S - 0.001)
    assert not door.report_due()
    clock.advance(0.001)
    assert door.report_due()


def test_the_limits_are_read_from_the_server_config_with_the_same_defaults() -> None:
    assert DoorLimits.of(ServerConfig()) == DoorLimits()
    cfg = ServerConfig(
        header_timeout_s=3.0,
        body_timeout_s=4.0,
        max_header_bytes=2048,
        max_header_count=9,
        max_connections=10,
        max_connections_per_ip=None,
        keep_alive_timeout_s=5.0,
        max_requests_per_connection=7,
        admission_rate_per_s=50.0,
        admission_burst=8,
    )
    limits = DoorLimits.of(cfg)
    assert {f: getattr(limits, f) for f in DoorLimits.__slots__} == {
        f: getattr(cfg, f) for f in DoorLimits.__slots__
    }
    assert limits != DoorLimits()
