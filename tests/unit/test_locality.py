"""The zone-routing rule (routing/locality.py) on a fake clock: Envoy's priority rule with the
overprovisioning factor, spill in proportion to healthy workers, no traffic to a zone without a healthy
worker, lost workers still expected, failback that ramps after a hold (no flapping), the choice of zone
per unit of work (smooth weighted round robin), the load spill only when a zone is short of capacity, the
ejector's verdict kept out of the shares, a late first worker without a ramp, and shares at scrape time."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from inferd.clock import FakeClock
from inferd.routing.locality import NO_ZONE, Backlog, LocalityPolicy, ZoneChoice


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
    p.join("c-0", "")  # an empty zone is no zone: it neither turns the rule on nor keeps it on
    assert not p.active
    p.join("c-0", "c")
    p.lose("c-0")
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


def backlog(queued: int, waited_s: float = 1.0, **kw: float | None) -> Backlog:
    """Work waiting for a zone's workers: batches of 8, a bound of 1000, a 10 ms floor; no deadline."""
    fields: dict = {"floor_s": 0.010, "bound": 1000, "max_batch": 8, "batch_s": 0.05, "remaining_s": None}
    fields.update(kw)
    return Backlog(waited_s=waited_s, queued=queued, **fields)


def test_a_momentarily_busy_zone_keeps_its_work_while_another_zone_is_idle() -> None:
    """Below its capacity a zone's busy worker frees within a batch's time: the work waits for it, however
    long past its floor, rather than cross zones (spills between equally busy zones gain nothing)."""
    p = policy("a", {"a": 2, "b": 2})
    shares = p.shares({"a": 2, "b": 2})  # all local
    assert p.choose(shares, {"b"}) == ZoneChoice(None)  # nothing waiting
    for queued in (1, 16, 64):  # up to 4 full batches per local worker in service: not short
        choice = p.choose(shares, {"b"}, backlog(queued, waited_s=10.0))
        assert choice == ZoneChoice(None, spill_at_queued=65)  # not by time; the dispatcher looks again at 65
    far = backlog(16, waited_s=10.0, remaining_s=30.0)  # a deadline far off: 2 batches take 0.05 s
    assert p.choose(shares, {"b"}, far) == ZoneChoice(None, spill_in_s=pytest.approx(29.9), spill_at_queued=65)


def test_load_spills_once_the_zone_is_short_after_its_floor_to_an_idle_zone_in_service() -> None:
    p = policy("a", {"a": 2, "b": 2, "c": 1})
    shares = p.shares({"a": 2, "b": 2, "c": 1})
    # a backlog of more than 4 full batches per worker in service
    early = p.choose(shares, {"b", "c"}, backlog(65, waited_s=0.004))
    assert early.zone is None and early.spill_in_s == pytest.approx(0.006)  # ... after its floor
    assert p.choose(shares, {"b", "c"}, backlog(65, waited_s=0.010)) == ZoneChoice("b", spilled=True)  # most in service
    # the queue past half its bound
    assert p.choose(shares, {"c"}, backlog(10, bound=20)) == ZoneChoice("c", spilled=True)
    # clearing the queue (2 batches x 0.05 s / 2 workers) takes more than half the oldest item's time left
    assert p.choose(shares, {"c"}, backlog(16, remaining_s=0.09)) == ZoneChoice("c", spilled=True)
    soon = p.choose(shares, {"c"}, backlog(16, waited_s=0.0, remaining_s=0.5))
    assert soon.zone is None and soon.spill_in_s == pytest.approx(0.4)  # when 0.1 s is half of what is left
    assert p.choose(shares, {"c"}, backlog(64, batch_s=None, remaining_s=0.01)).zone is None  # nothing measured
    # only to an idle zone in service: not one whose workers are all ejected, nor one without a healthy worker
    ejected_c = p.shares({"a": 2, "b": 2, "c": 1}, serving={"a": 2, "b": 2, "c": 0})
    assert p.choose(ejected_c, {"c"}, backlog(100)) == ZoneChoice(None)
    assert p.choose(p.shares({"a": 2}), {"b"}, backlog(100)) == ZoneChoice(None)
    p.served("b", 3)
    p.served("a", 5)
    stats = {z.zone: z for z in p.statistics().zones}
    assert (stats["a"].served, stats["a"].spilled, stats["a"].local) == (5, 0, True)
    assert (stats["b"].served, stats["b"].spilled, stats["b"].local) == (3, 3, False)


def test_an_ejected_worker_steers_the_work_but_keeps_its_zones_share() -> None:
    """The outlier ejector's verdict is no zone health: a one-worker zone whose worker is ejected keeps its
    share (no failback hold when it returns), and its work spills at once, with no floor, while it is out."""
    p = policy("a", {"a": 1, "b": 1})
    assert p.shares({"a": 1, "b": 1}).local_share == 1.0
    out = p.shares({"a": 1, "b": 1}, serving={"a": 0, "b": 1})  # a-0 ejected
    assert out.local_share == 1.0 and out.rule == 1.0
    assert p.choose(out, {"b"}, backlog(1, waited_s=0.0)) == ZoneChoice("b", spilled=True)
    clock(p).advance(5.0)
    back = p.shares({"a": 1, "b": 1})
    assert back.local_share == 1.0 and p.choose(back, {"a", "b"}, backlog(1)) == ZoneChoice("a")


def test_a_zone_whose_first_worker_joins_late_starts_at_the_rule() -> None:
    """A front end that started before its zone's workers: the zone had no expected worker, it did not
    fall, so there is no failback hold or ramp when its first worker joins."""
    p = policy("a", {"b": 1})
    assert p.shares({"b": 1}).shares == {"b": 1.0}  # nothing local yet
    clock(p).advance(0.5)
    p.join("a-0", "a")
    assert p.shares({"a": 1, "b": 1}).local_share == 1.0
    p.lose("a-0")  # but a zone that falls does hold
    assert p.shares({"b": 1}).local_share == 0.0
    p.join("a-0", "a")
    assert p.shares({"a": 1, "b": 1}).local_share == 0.0
    clock(p).advance(5.0 + 5.0)
    assert p.shares({"a": 1, "b": 1}).local_share == pytest.approx(0.5)


def test_statistics_given_the_fleet_compute_the_shares_now() -> None:
    """/metrics reads the shares at scrape time: true while no work is placed."""
    p = policy("a", {"a": 2, "b": 2})
    assert p.shares({"a": 2, "b": 2}).local_share == 1.0
    p.lose("a-0")
    p.lose("a-1")
    assert p.statistics().local_share == 1.0  # the last shares placed work by
    now = p.statistics({"b": 2})
    assert now.local_share == 0.0 and {z.zone: z.share for z in now.zones} == {"a": 0.0, "b": 1.0}
    clock(p).advance(1.0)
    assert p.statistics().local_share == 0.0


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
