"""The zone-routing rule (routing/locality.py) on a fake clock: Envoy's priority rule with the
overprovisioning factor, spill in proportion to healthy workers, no traffic to a zone without a healthy
worker, lost workers still expected, failback that ramps after a hold (no flapping), the choice of zone
per unit of work (smooth weighted round robin) and the load spill."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from inferd.clock import FakeClock
from inferd.routing.locality import NO_ZONE, LocalityPolicy, ZoneChoice


def policy(zone: str | None = "a", fleet: dict[str, int] | None = None, **kw: float) -> LocalityPolicy:
    """A policy for a front end in `zone`, with `fleet`: zone -> workers joined (ids "<zone>-<i>")."""
    p = LocalityPolicy(FakeClock(), zone, **kw)
    for z, n in (fleet or {}).items():
        for i in range(n):
            p.join(f"{z}-{i}", z or None)
    return p


def clock(p: LocalityPolicy) -> FakeClock:
    assert isinstance(p.clock, FakeClock)
    return p.clock


def test_a_front_end_or_workers_without_a_zone_leave_the_rule_out() -> None:
    assert not policy(None, {"a": 2, "b": 2}).active  # the front end names no zone
    assert not policy("a", {"": 3}).active  # no worker names one
    p = policy("a", {"": 1})
    p.join("b-0", "b")
    assert p.active
    p.leave("b-0")
    assert not p.active


def test_all_local_workers_healthy_keep_every_unit_of_work_local() -> None:
    p = policy("a", {"a": 3, "b": 3})
    shares = p.shares({"a": 3, "b": 3})
    assert shares.shares == {"a": 1.0} and shares.local_share == 1.0 and shares.rule == 1.0
    picks = Counter()
    for _ in range(10):
        zone = p.choose(shares, {"a", "b"}).zone
        assert zone is not None
        p.served(zone)
        picks[zone] += 1
    assert picks == {"a": 10}


def test_the_overprovisioning_factor_keeps_work_local_until_the_healthy_share_falls_below_its_inverse() -> None:
    p = policy("a", {"a": 10, "b": 5, "c": 5})
    assert p.shares({"a": 8, "b": 5, "c": 5}).shares == {"a": 1.0}  # 1.4 x 0.8 = 1.12: still all local
    shares = p.shares({"a": 5, "b": 4, "c": 1})  # 1.4 x 0.5 = 0.7 local; 0.3 to b and c as 4 : 1
    assert shares.local_share == pytest.approx(0.7)
    assert shares.of("b") == pytest.approx(0.3 * 4 / 5) and shares.of("c") == pytest.approx(0.3 / 5)
    assert math.fsum(shares.shares.values()) == pytest.approx(1.0)
    assert policy("a", {"a": 10, "b": 5}, overprovisioning=1.0).shares({"a": 9, "b": 5}).local_share == 0.9


def test_when_every_zone_is_short_the_shares_are_scaled_to_sum_to_one() -> None:
    """Envoy's normalization: local health 1.4 x 0.2 = 0.28, the others' 1.4 x 0.2 = 0.28: half each."""
    shares = policy("a", {"a": 10, "b": 10}).shares({"a": 2, "b": 2})
    assert shares.local_share == pytest.approx(0.5) and shares.of("b") == pytest.approx(0.5)


def test_a_zone_without_a_healthy_worker_gets_nothing() -> None:
    p = policy("a", {"a": 2, "b": 2, "c": 2})
    shares = p.shares({"a": 0, "b": 2, "c": 0})
    assert shares.shares == {"b": 1.0}
    assert p.choose(shares, {"a", "c"}) == ZoneChoice(None)  # free workers there take nothing
    assert p.shares({}).shares == {}  # nobody healthy: no shares (the caller routes as without zones)


def test_no_local_worker_at_all_sends_everything_to_the_other_zones() -> None:
    shares = policy("a", {"b": 1, "c": 3}).shares({"b": 1, "c": 3})
    assert shares.local_share == 0.0 and shares.of("b") == pytest.approx(0.25) and shares.of("c") == 0.75


def test_a_lost_worker_stays_expected_until_its_time_is_up_or_another_takes_its_place() -> None:
    p = policy("a", {"a": 4, "b": 4}, lost_expected_s=60.0)
    p.lose("a-0")
    p.lose("a-1")
    assert p.expected("a") == 4
    assert p.shares({"a": 2, "b": 4}).local_share == pytest.approx(0.7)  # 1.4 x 2/4
    p.join("a-9", "a")  # a replacement under another id takes a lost one's place
    assert p.expected("a") == 4
    clock(p).advance(61.0)
    assert p.expected("a") == 3  # the other lost one is forgotten
    p.leave("a-2")  # draining: no longer expected at once
    assert p.expected("a") == 2


def test_the_local_share_falls_at_once_and_comes_back_after_a_hold_over_the_failback_ramp() -> None:
    p = policy("a", {"a": 2, "b": 2}, failback_s=10.0, hold_s=5.0)
    c = clock(p)
    assert p.shares({"a": 2, "b": 2}).local_share == 1.0
    p.lose("a-0")
    p.lose("a-1")
    assert p.shares({"b": 2}).shares == {"b": 1.0}  # the zone is lost: at once
    c.advance(20.0)
    p.join("a-0", "a")
    p.join("a-1", "a")  # healed
    seen = []
    for _ in range(20):
        shares = p.shares({"a": 2, "b": 2})
        assert shares.rule == 1.0
        assert math.fsum(shares.shares.values()) == pytest.approx(1.0)
        seen.append(round(shares.local_share, 3))
        c.advance(1.0)
    assert seen[:6] == [0.0] * 6  # held for 5 s
    assert seen[6:16] == [round(0.1 * i, 3) for i in range(1, 11)]  # then 0.1 a second
    assert seen[16:] == [1.0] * 4
    assert seen == sorted(seen)  # never down on the way up


def test_a_flapping_worker_does_not_flap_the_share() -> None:
    """A local worker lost and back every 2 s (faster than the 5 s hold): the share stays at its low value
    instead of following it."""
    p = policy("a", {"a": 5, "b": 5}, overprovisioning=1.0, failback_s=10.0, hold_s=5.0)
    c = clock(p)
    assert p.shares({"a": 5, "b": 5}).local_share == 1.0
    seen = []
    for _ in range(10):
        p.lose("a-0")
        seen.append(p.shares({"a": 4, "b": 5}).local_share)
        c.advance(2.0)
        p.join("a-0", "a")
        seen.append(p.shares({"a": 5, "b": 5}).local_share)
        c.advance(2.0)
    assert seen == [pytest.approx(0.8)] * 20
    c.advance(4.0)  # stable at last since the last call, 2 s ago: the 5 s hold, then the ramp
    assert p.shares({"a": 5, "b": 5}).local_share == pytest.approx(0.9)
    c.advance(1.0)
    assert p.shares({"a": 5, "b": 5}).local_share == 1.0


def test_a_fall_during_the_ramp_drops_at_once_and_restarts_the_hold() -> None:
    p = policy("a", {"a": 4, "b": 4}, overprovisioning=1.0, failback_s=10.0, hold_s=2.0)
    c = clock(p)
    p.shares({"a": 4, "b": 4})
    p.shares({"a": 0, "b": 4})
    c.advance(1.0)
    p.shares({"a": 4, "b": 4})  # the rise starts here
    c.advance(2.0 + 5.0)
    assert p.shares({"a": 4, "b": 4}).local_share == pytest.approx(0.5)
    assert p.shares({"a": 1, "b": 4}).local_share == pytest.approx(0.25)  # below the ramp: at once
    c.advance(1.0)
    assert p.shares({"a": 4, "b": 4}).local_share == pytest.approx(0.25)  # held again
    c.advance(2.0 + 1.0)
    assert p.shares({"a": 4, "b": 4}).local_share == pytest.approx(0.35)


def test_choices_follow_the_shares_exactly_and_spread_evenly() -> None:
    p = policy("a", {"a": 10, "b": 10}, overprovisioning=1.0)
    shares = p.shares({"a": 7, "b": 10})
    assert shares.local_share == pytest.approx(0.7)
    picks = []
    for _ in range(100):
        zone = p.choose(shares, {"a", "b"}).zone
        assert zone is not None
        p.served(zone)
        picks.append(zone)
    assert Counter(picks) == {"a": 70, "b": 30}
    assert max(len(run) for run in "".join(picks).split("a")) == 1  # b's turns are spread, not bunched


def test_a_zone_with_a_share_but_no_free_worker_leaves_its_turn_to_the_others() -> None:
    p = policy("a", {"a": 10, "b": 10}, overprovisioning=1.0)
    shares = p.shares({"a": 5, "b": 10})
    assert p.choose(shares, {"b"}) == ZoneChoice("b")
    assert p.choose(shares, {"a"}) == ZoneChoice("a")


def test_load_spills_to_another_zone_only_after_the_batching_wait() -> None:
    p = policy("a", {"a": 2, "b": 2})
    shares = p.shares({"a": 2, "b": 2})  # all local
    assert p.choose(shares, {"b"}) == ZoneChoice(None)  # nothing waiting yet
    early = p.choose(shares, {"b"}, waited_s=0.004, wait_s=0.010)
    assert early.zone is None and early.spill_in_s == pytest.approx(0.006)
    late = p.choose(shares, {"b"}, waited_s=0.010, wait_s=0.010)
    assert late == ZoneChoice("b", spilled=True)
    p.served("b", 3)
    p.served("a", 5)
    stats = {z.zone: z for z in p.statistics().zones}
    assert (stats["a"].served, stats["a"].spilled, stats["a"].local) == (5, 0, True)
    assert (stats["b"].served, stats["b"].spilled, stats["b"].local) == (3, 3, False)
    assert p.choose(p.shares({"a": 2}), {"b"}, waited_s=1.0, wait_s=0.01) == ZoneChoice(None)  # b unhealthy


def test_statistics_say_the_rule_and_each_zone() -> None:
    p = policy("a", {"a": 4, "b": 2, "": 1}, overprovisioning=1.0)
    p.shares({"a": 2, "b": 2, NO_ZONE: 1})
    s = p.statistics()
    assert (s.local, s.active, s.local_share, s.rule_share) == ("a", True, 0.5, 0.5)
    by_zone = {z.zone: (z.share, z.healthy, z.expected) for z in s.zones}
    assert by_zone == {"": (pytest.approx(0.5 / 3), 1, 1), "a": (0.5, 2, 4), "b": (pytest.approx(1 / 3), 2, 2)}


@pytest.mark.parametrize("factor", [0.99, 0.0, float("nan"), float("inf")])
def test_an_overprovisioning_below_one_is_refused(factor: float) -> None:
    with pytest.raises(ValueError, match="overprovisioning must be >= 1"):
        LocalityPolicy(FakeClock(), "a", overprovisioning=factor)


def test_work_that_cannot_wait_tries_the_chosen_zone_then_the_shared_ones_then_the_others() -> None:
    p = policy("a", {"a": 10, "b": 2, "c": 6, "d": 1}, overprovisioning=1.0)
    shares = p.shares({"a": 10, "b": 2, "c": 6, "d": 0})
    assert p.order(shares, {"a", "b", "c", "d"}) == ["a", "c", "b"]  # d: no healthy worker, never tried
    shares = p.shares({"a": 5, "b": 2, "c": 6})  # a: 0.5, then b and c share the rest 1 : 3
    assert p.order(shares, {"b", "c"}) == ["c", "b"]
