"""Zone-aware routing, Envoy's priority rule: a front end sends a model's work to workers of its own zone,
and spills to the other zones only as its zone's healthy capacity runs short, by an overprovisioning
factor; when its zone heals, the work comes back gradually, without flapping.

A plain object with an injected clock and no I/O, one per model version. The caller tells it which workers
exist (`join` with their zone, `leave` when one drains, `lose` when one is lost), how many of each zone's are
healthy now (`shares`), and what it sent where (`served`); decisions come back as values (`ZoneShares`,
`ZoneChoice`).

The rule:

* **Zones.** The front end's zone is the local one. It is in force only when the front end has a zone and
  at least one of the model's workers has one (`active`); otherwise every worker is one pool, as without
  zones. A worker without a zone counts as a zone of its own, "" (not the local one).
* **Health.** A zone's *expected* workers are those that joined and are not draining, plus those lost in
  the last `lost_expected_s` (a worker joining the zone again takes a lost one's place); its *healthy*
  workers are the caller's count of those connected and ready now (joined, not draining, not lost). The
  outlier ejector's verdict is not health here: one slow batch must not take a one-worker zone's share
  away for the failback's hold and ramp. The caller gives its own count of the workers *in service*
  (healthy and not ejected, `serving`): the ejector steers the choice of worker within a zone, and a
  zone with a share but none in service is short at once (load spill, below).
* **The local share** is `min(1, overprovisioning x healthy_local / expected_local)` (0 with no expected
  local worker). The other zones together get `min(1 - local, min(1, overprovisioning x healthy_other /
  expected_other))`; when the two add up to less than 1 (both short), both are scaled up to sum to 1. The
  other zones split theirs in proportion to their healthy workers. A zone with no healthy worker gets
  nothing; with no healthy worker anywhere the shares are empty (the caller routes as without zones).
* **Failback without flapping.** The local share falls at once when the rule's value falls. It rises only
  after the rule's value has stayed above it for `hold_s` without a new fall, then by at most 1 per
  `failback_s` (a ramp), up to the rule's value. A worker that flaps faster than `hold_s` keeps the share
  at its low value instead of flapping it. A zone that had no expected worker did not fall: when its
  first worker joins (a front end that started before its zone's workers), its share starts at the
  rule's value.
* **Choosing a zone for one unit of work** (a batch, a sequence: `choose`): among the zones with a free
  worker and a share, the one most behind its share (smooth weighted round robin over what was `served`).
* **Load spill.** A zone with a share whose worker is momentarily busy is not short of capacity: the
  work waits for it, even while another zone's worker is idle (below its capacity a zone's worker frees
  within a batch's time). Work spills beyond the shares only when the zones with a share are *short*,
  from the `Backlog` the caller gives: none of their workers is in service; or what is queued would take
  them more than `spill_backlog` full batches per worker in service to clear (a sustained backlog, not
  a busy moment); or the time to clear it (batches x the measured batch time / workers in service)
  exceeds `spill_deadline_share` of the oldest item's remaining deadline (admission would soon refuse
  on it); or the queue is past `spill_queue_share` of its bound. Even then it waits its floor first
  (its batching wait plus a batch's time, `Backlog.floor_s`; not when no worker with a share is in
  service), and goes only to a zone with an idle worker in service, nothing of any front end's running
  on it (the one with most workers in service). A zone over its capacity so spills instead of
  refusing, and zones equally busy keep their work. The choice says when the work may spill
  (`spill_in_s`, as its deadline nears) or at what queue length (`spill_at_queued`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from inferd.clock import Clock

NO_ZONE = ""
"""The zone of a worker that named none."""
_TICK_S = 1e-6
"""Work that waited its floor, or a zone short within this, is so (the timer set for it may fire a rounding
error early)."""


@dataclass(frozen=True, slots=True)
class ZoneShares:
    """Each zone's share of the model's work now (summing to 1; empty: no healthy worker anywhere)."""

    local: str
    shares: Mapping[str, float] = field(default_factory=dict)
    healthy: Mapping[str, int] = field(default_factory=dict)
    """The healthy workers the shares were computed from, per zone."""
    rule: float = 0.0
    """The local share the rule gives now, before failback holds it lower."""
    serving: Mapping[str, int] = field(default_factory=dict)
    """Of the healthy workers, those in service (not ejected), per zone."""

    def of(self, zone: str) -> float:
        return self.shares.get(zone, 0.0)

    @property
    def local_share(self) -> float:
        return self.of(self.local)


@dataclass(frozen=True, slots=True)
class Backlog:
    """The work waiting for a worker, as the caller sees it (what the load spill decides from)."""

    waited_s: float
    """How long the oldest waiting item has waited."""
    floor_s: float
    """The least it waits for a worker of a zone with a share before it may spill: its batching wait
    plus a batch's time (the longest a busy worker there takes to free)."""
    queued: int
    """Items waiting for the model (the oldest included)."""
    bound: int
    """The queue's bound (admission refuses past it)."""
    max_batch: int
    batch_s: float | None = None
    """A batch's time, measured (EWMA); None: none measured yet."""
    remaining_s: float | None = None
    """The oldest item's remaining deadline; None: it has none."""


@dataclass(frozen=True, slots=True)
class ZoneChoice:
    """Where one unit of work goes. `zone` None: nowhere now (no zone with a share has a free worker);
    `spill_in_s`: in how long it may spill to a free worker of another zone, `spill_at_queued`: at how
    many items queued (None: not by time, not by queue length)."""

    zone: str | None
    spilled: bool = False
    """Beyond the shares, to a zone with none: the zones with a share were short of capacity."""
    spill_in_s: float | None = None
    spill_at_queued: int | None = None


@dataclass(frozen=True, slots=True)
class ZoneStatistics:
    zone: str
    local: bool
    share: float
    healthy: int
    expected: int
    served: int
    """Units of work (batch items, sequences) sent to the zone's workers since start."""
    spilled: int
    """Of those, sent beyond the shares (load spill)."""


@dataclass(frozen=True, slots=True)
class LocalityStatistics:
    local: str
    active: bool
    local_share: float
    rule_share: float
    """The local share the rule gives now; above `local_share` while failback ramps."""
    zones: tuple[ZoneStatistics, ...]


@dataclass(slots=True)
class _Zone:
    members: set[str] = field(default_factory=set)
    lost: dict[str, float] = field(default_factory=dict)
    """Lost worker id -> when: still expected until `lost_expected_s` after."""
    served: int = 0
    spilled: int = 0
    credit: float = 0.0
    """Smooth weighted round robin: how far the zone is behind its share (in units of work)."""


class LocalityPolicy:
    def __init__(
        self,
        clock: Clock,
        zone: str | None,
        *,
        overprovisioning: float = 1.4,
        failback_s: float = 10.0,
        hold_s: float = 5.0,
        lost_expected_s: float = 60.0,
        spill_backlog: float = 4.0,
        spill_deadline_share: float = 0.5,
        spill_queue_share: float = 0.5,
    ) -> None:
        if not (math.isfinite(overprovisioning) and overprovisioning >= 1.0):
            raise ValueError(f"overprovisioning must be >= 1, got {overprovisioning}")
        if failback_s <= 0 or hold_s < 0 or lost_expected_s < 0:
            raise ValueError(
                f"need failback_s > 0, hold_s >= 0 and lost_expected_s >= 0, got {failback_s}, {hold_s}, "
                f"{lost_expected_s}"
            )
        if spill_backlog <= 0 or not (0 < spill_deadline_share <= 1 and 0 < spill_queue_share <= 1):
            raise ValueError(
                f"need spill_backlog > 0 and spill shares in (0, 1], got {spill_backlog}, "
                f"{spill_deadline_share}, {spill_queue_share}"
            )
        self.clock = clock
        self.zone = zone
        self.overprovisioning = overprovisioning
        self.failback_s = failback_s
        self.hold_s = hold_s
        self.lost_expected_s = lost_expected_s
        self.spill_backlog = spill_backlog
        self.spill_deadline_share = spill_deadline_share
        self.spill_queue_share = spill_queue_share
        self._zones: dict[str, _Zone] = {}
        self._zone_of: dict[str, str] = {}
        self._zoned = 0
        """Members that named a zone (the rule is in force only with one)."""
        self._local: float | None = None
        """The local share in force (None: not computed yet)."""
        self._rising_since: float | None = None
        """Since when the rule's value has stayed above the share in force (None: it has not)."""
        self._rise_base = 0.0
        self._last = ZoneShares(zone or NO_ZONE)

    # ---- the fleet -------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether zones steer the work: the front end has a zone and a worker has one."""
        return self.zone is not None and self._zoned > 0

    def join(self, worker_id: str, zone: str | None) -> None:
        """The worker is in service in `zone` (None: it named none); it takes a lost worker's place there."""
        self.leave(worker_id)
        name = zone or NO_ZONE
        z = self._zones.setdefault(name, _Zone())
        if z.lost:
            del z.lost[worker_id if worker_id in z.lost else min(z.lost, key=z.lost.__getitem__)]
        z.members.add(worker_id)
        self._zone_of[worker_id] = name
        self._zoned += name != NO_ZONE

    def leave(self, worker_id: str) -> None:
        """The worker drains (or leaves for good): it is no longer expected."""
        name = self._zone_of.pop(worker_id, None)
        if name is not None:
            self._zones[name].members.discard(worker_id)
            self._zoned -= name != NO_ZONE

    def lose(self, worker_id: str) -> None:
        """The worker was lost (its connection broke, it died): still expected, and unhealthy, for
        `lost_expected_s` or until a worker joins its zone in its place."""
        name = self._zone_of.get(worker_id)
        self.leave(worker_id)
        if name is not None and self.lost_expected_s > 0:
            self._zones[name].lost[worker_id] = self.clock.now()

    def zone_of(self, worker_id: str) -> str:
        return self._zone_of.get(worker_id, NO_ZONE)

    def expected(self, zone: str) -> int:
        z = self._zones.get(zone)
        if z is None:
            return 0
        cutoff = self.clock.now() - self.lost_expected_s
        for wid in [w for w, at in z.lost.items() if at <= cutoff]:
            del z.lost[wid]
        return len(z.members) + len(z.lost)

    # ---- the rule ---------------------------------------------------------------------------------------
    def shares(self, healthy: Mapping[str, int], serving: Mapping[str, int] | None = None) -> ZoneShares:
        """Each zone's share now, from its healthy workers (`healthy`: zone -> count; "" for workers without
        a zone) and, of those, the ones in service (`serving`; None: all of them). Moves the failback
        state: call it when work is to be placed, or to report the shares, not in a loop of its own."""
        local = self.zone or NO_ZONE
        counts = {z: m for z, n in healthy.items() if n > 0 and (m := min(n, self.expected(z))) > 0}
        in_service = dict(counts) if serving is None else {z: min(serving.get(z, 0), n) for z, n in counts.items()}
        expected_local = self.expected(local)
        rule = self._health(counts.get(local, 0), expected_local)
        if expected_local == 0:  # no expected worker: nothing fell, and its first worker starts at the rule
            self._local, self._rising_since, own = None, None, 0.0
        else:
            own = self._failback(rule)
        others = {z: n for z, n in counts.items() if z != local}
        expected_others = sum(self.expected(z) for z in self._zones if z != local)
        spill = min(1.0 - own, self._health(sum(others.values()), expected_others))
        total = own + spill
        if total <= 0.0:
            # failback holds the local share at 0 while no other zone can take the work: it is the local one's
            own, total = (1.0, 1.0) if counts.get(local) else (0.0, 0.0)
        shares: dict[str, float] = {}
        if own > 0.0:
            shares[local] = own / total
        healthy_others = sum(others.values())
        for z, n in others.items() if spill > 0.0 else ():
            shares[z] = spill / total * n / healthy_others
        self._last = ZoneShares(local, shares, counts, rule, in_service)
        return self._last

    def _health(self, healthy: int, expected: int) -> float:
        """Envoy's health of a priority level: overprovisioning x its healthy share, at most 1."""
        return 0.0 if expected <= 0 else min(1.0, self.overprovisioning * healthy / expected)

    def _failback(self, rule: float) -> float:
        """The local share in force: falls at once to the rule's value, rises after `hold_s` by 1 per
        `failback_s`."""
        now = self.clock.now()
        current = self._local
        if current is None or rule <= current:
            self._local, self._rising_since = rule, None
            return rule
        if self._rising_since is None:
            self._rising_since, self._rise_base = now, current
        ramp = max(0.0, now - self._rising_since - self.hold_s) / self.failback_s
        self._local = min(rule, self._rise_base + ramp)
        if self._local >= rule:
            self._rising_since = None
        return self._local

    # ---- choosing --------------------------------------------------------------------------------------
    def choose(self, shares: ZoneShares, free: Collection[str], backlog: Backlog | None = None) -> ZoneChoice:
        """The zone for the next unit of work, among the zones with a free worker (`free`). `backlog`: the
        work waiting (None: none waits; it may not spill)."""
        best: str | None = None
        best_credit = 0.0
        for zone in free:
            share = shares.of(zone)
            if share <= 0.0:
                continue
            z = self._zones.get(zone)
            credit = share + (z.credit if z is not None else 0.0)
            if best is None or credit > best_credit:
                best, best_credit = zone, credit
        if best is not None:
            return ZoneChoice(best)
        spill = [z for z in free if shares.serving.get(z, 0) > 0]
        if backlog is None:
            return ZoneChoice(None)
        return self._spill(shares, spill, backlog)

    def short(self, shares: ZoneShares, backlog: Backlog | None) -> bool:
        """Whether the zones with a share are short of capacity for the waiting work now (the load spill's
        test, its floor aside): the caller then asks the other zones' workers for slots, and not before
        (a slot held there unused would be one less for that zone's own front end)."""
        return bool(shares.shares) and backlog is not None and self._short_in(shares, backlog)[0] <= _TICK_S

    def _spill(self, shares: ZoneShares, spill: list[str], backlog: Backlog) -> ZoneChoice:
        """The load spill (the module's docstring): to a zone in `spill` (idle workers in service, no
        share) if the zones with a share are short, after the floor; else when it may."""
        target = max(spill, key=lambda z: (shares.serving[z], z)) if spill else None
        short_in, at_queued = self._short_in(shares, backlog)
        if at_queued is None:  # none in service where the shares send the work (all ejected): no point waiting
            return ZoneChoice(target, spilled=target is not None)
        if target is None:
            return ZoneChoice(None)
        floor_in = backlog.floor_s - backlog.waited_s
        if short_in > _TICK_S:
            spill_in = None if math.isinf(short_in) else max(short_in, floor_in)
            return ZoneChoice(None, spill_in_s=spill_in, spill_at_queued=at_queued)
        if floor_in > _TICK_S:
            return ZoneChoice(None, spill_in_s=floor_in)
        return ZoneChoice(target, spilled=True)

    def _short_in(self, shares: ZoneShares, backlog: Backlog) -> tuple[float, int | None]:
        """In how long the zones with a share are short of capacity for `backlog` (0: now; inf: not by
        time), and at how many items queued they are (None: short now, with no worker in service)."""
        serving = sum(n for z, n in shares.serving.items() if shares.of(z) > 0.0)
        if serving == 0:
            return 0.0, None
        at_queued = min(  # more than spill_backlog full batches per worker in service, or the queue's share
            math.floor(self.spill_backlog * serving * backlog.max_batch) + 1,
            math.ceil(self.spill_queue_share * backlog.bound),
        )
        if backlog.queued >= at_queued:
            return 0.0, at_queued
        if backlog.batch_s is None or backlog.remaining_s is None:
            return math.inf, at_queued
        clear_s = math.ceil(backlog.queued / backlog.max_batch) * backlog.batch_s / serving
        return max(0.0, backlog.remaining_s - clear_s / self.spill_deadline_share), at_queued

    @property
    def last(self) -> ZoneShares:
        """The shares last computed."""
        return self._last

    def order(self, shares: ZoneShares, zones: Collection[str]) -> list[str]:
        """The zones to try in turn for work that cannot wait (an LLM sequence: its zone full is a 429):
        `choose`'s zone, then the other zones with a share (larger first), then the other healthy ones (a
        load spill, more healthy workers first). Zones without a healthy worker are not tried."""
        first = self.choose(shares, zones).zone
        rest = sorted(
            (z for z in zones if z != first and shares.healthy.get(z, 0) > 0),
            key=lambda z: (-shares.of(z), -shares.healthy.get(z, 0), z),
        )
        return rest if first is None else [first, *rest]

    def served(self, zone: str, n: int = 1) -> None:
        """`n` units of work went to a worker of `zone` (one batch's items, a sequence): beyond the shares
        (a load spill) if the last shares gave the zone none."""
        z = self._zones.setdefault(zone, _Zone())
        z.served += n
        shares = self._last.shares
        if zone not in shares:
            z.spilled += n if shares else 0
            return
        for name, share in shares.items():
            other = self._zones.setdefault(name, _Zone())
            other.credit = min(1.0, other.credit + share)  # bounded: a zone long without a free worker
        z.credit = max(-1.0, z.credit - 1.0)  # does not take a burst when one frees

    # ---- snapshots --------------------------------------------------------------------------------------
    def statistics(
        self, healthy: Mapping[str, int] | None = None, serving: Mapping[str, int] | None = None
    ) -> LocalityStatistics:
        """What the policy did and gives now. With `healthy` (and `serving`, as for `shares`) the shares are
        computed now, so a scrape sees them true while no work is placed; without, the last ones."""
        if healthy is not None and self.active:
            self.shares(healthy, serving)
        local, last = self.zone or NO_ZONE, self._last
        zones = tuple(
            ZoneStatistics(
                name, name == local, last.of(name), last.healthy.get(name, 0), self.expected(name), z.served, z.spilled
            )
            for name, z in sorted(self._zones.items())
        )
        return LocalityStatistics(local, self.active, last.local_share, last.rule, zones)
