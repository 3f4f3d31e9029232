"""The front end's view of a search index's replicas: which shard each serves, how far it has applied
the shard's log, what it holds in flight, how fast it answers; and the choice of a replica for a read
(power of two choices on load among the fresh ones). Plain objects, no I/O."""

from __future__ import annotations

import asyncio
import enum
import math
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from inferd.wire.connection import WorkerConnection, WorkerState

LATENCY_WEIGHT = 0.3
"""Weight of a new latency in a replica's moving average (a higher one than the average counts whole)."""
LATENCY_DECAY_S = 1.0
"""A replica's latency estimate decays with the time since its last sample (e-fold per second), so a
replica avoided for being slow is tried again after a while, and a recovered one gets its load back."""
SLOW_RATIO = 3.0
"""A replica whose latency estimate is this many times its fastest peer's is slow: it gets only probes
(see ReplicaChooser), and its estimate stops decaying, so only answers of its own can clear it."""
SLOW_MARGIN_S = 0.002
"""...and at least this much slower (sub-millisecond jitter is not a slow replica)."""
SLOW_SAMPLES = 3
"""The verdict judges an average of a replica's answers (not its peak estimate), and is given only when
its last this many samples were each over the slow line too: one spike (a burst queueing calls) is not
a slow replica."""
PROBE_SHARE = 0.01
"""The share of first requests that may go to slow replicas as probes (one in flight per replica)."""


class ReplicaPhase(enum.Enum):
    ASSIGNING = "assigning"
    """Told its shard; loading the snapshot."""
    SERVING = "serving"
    """Applying the log as it is shipped, answering reads."""
    GONE = "gone"

    TERMINAL: frozenset[ReplicaPhase]


ReplicaPhase.TERMINAL = frozenset({ReplicaPhase.GONE})


@dataclass(eq=False)
class Replica:
    conn: WorkerConnection
    shard: int
    phase: ReplicaPhase = ReplicaPhase.ASSIGNING
    applied_seq: int = 0
    """The last seq it has applied (from its replies)."""
    shipped_seq: int = 0
    """The last seq sent to it (applied once its apply call answers)."""
    documents: int = 0
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    """Calls sent and not answered yet (call id -> the caller's future)."""
    reads: int = 0
    latency_s: float = 0.0
    """Peak moving average of its read latency (a slower sample is taken whole, a faster one averaged)."""
    sampled_at: float = -math.inf
    mean_s: float = 0.0
    """Moving average of its read latency, both ways (what the slow verdict judges)."""
    recent_s: deque[float] = field(default_factory=lambda: deque(maxlen=SLOW_SAMPLES))
    """Its last SLOW_SAMPLES latencies (the verdict needs each of them over the slow line)."""
    slow: bool = False
    """The chooser's verdict (SLOW_RATIO against its peers): it gets only probes (kinds/search/hedge.py hedges
    those at once)."""

    def observe(self, latency_s: float, now: float, lower_bound: bool = False) -> None:
        """A read answered after `latency_s`; or, with `lower_bound`, was given up unanswered after that
        long (it counts only when it raises the estimate)."""
        current = self.expected_s(now)
        if not lower_bound or latency_s > self.mean_s:
            first = not self.recent_s
            self.mean_s = latency_s if first else self.mean_s + LATENCY_WEIGHT * (latency_s - self.mean_s)
            self.recent_s.append(latency_s)
        if lower_bound and latency_s <= current:
            return
        self.latency_s = max(latency_s, current + LATENCY_WEIGHT * (latency_s - current))
        self.sampled_at = now

    def expected_s(self, now: float) -> float:
        """The latency estimate, decayed with the time since its last sample (not while it is slow)."""
        if self.slow:
            return self.latency_s
        return self.latency_s * math.exp(-max(0.0, now - self.sampled_at) / LATENCY_DECAY_S)

    def cost(self, now: float) -> float:
        """What a read sent now is expected to wait: (calls in flight + 1) x the latency estimate."""
        return (self.load + 1) * self.expected_s(now)

    @property
    def worker_id(self) -> str:
        return self.conn.worker_id

    @property
    def readable(self) -> bool:
        return self.phase is ReplicaPhase.SERVING and self.conn.state is WorkerState.READY

    @property
    def load(self) -> int:
        return len(self.pending)


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    worker_id: str
    pid: int
    shard: int
    phase: str
    applied_seq: int
    documents: int
    in_flight: int


def least_served_shard(shards: int, replicas: Iterable[Replica]) -> int:
    """The shard a joining replica should serve: the one with the fewest live replicas (lowest first)."""
    counts = [0] * shards
    for r in replicas:
        if r.phase is not ReplicaPhase.GONE and 0 <= r.shard < shards:
            counts[r.shard] += 1
    return min(range(shards), key=lambda s: (counts[s], s))


class ReplicaChooser:
    """Power of two choices among a shard's readable replicas, preferring fresh ones (applied at least
    `min_seq`), then the lower cost (calls in flight + 1, times the latency estimate: a slow replica is
    avoided even when nothing is in flight); counts how often the two costs tie (whether the load
    signal does anything). A second request of a read (a hedge, a failover: `exclude` holds the replicas
    already asked) never goes to a stale replica when one already asked was fresh.

    A replica whose average is SLOW_RATIO times its fastest peer's (and SLOW_MARGIN_S more), on each of
    its last SLOW_SAMPLES answers too, is marked slow and left out of the choice: it gets at most
    PROBE_SHARE of the first requests as probes, one in flight at a time (`probed` says the last choice
    was one: the scatter hedges it at once, so no search waits on it). Its estimate's decay does not
    bring it back; answers of its own do (probes that answer first, averaged in), or having no peer
    left to compare with."""

    def __init__(self, rng: random.Random | None = None, probe_share: float = PROBE_SHARE) -> None:
        self.rng = rng or random.Random()  # nosec B311  # replica choice, not secrets
        self.probe_share = probe_share
        self.choices = 0
        self.ties = 0
        self.probes = 0
        self.probed = False
        """Whether the last choice was a probe of a slow replica."""
        self._probe_credit = 0.0

    def choose(
        self, candidates: list[Replica], min_seq: int, exclude: set[Replica], now: float = 0.0
    ) -> Replica | None:
        self.probed = False
        readable = [r for r in candidates if r.readable]
        live = [r for r in readable if r not in exclude]
        if not live:
            return None
        fresh = [r for r in live if r.applied_seq >= min_seq]
        if not fresh and any(r.applied_seq >= min_seq for r in exclude):
            return None  # a fresh one was asked: a stale answer would miss an acknowledged write
        pool = fresh or [max(live, key=lambda r: r.applied_seq)]  # none fresh: the freshest answers
        self.choices += 1
        self._judge(readable, now)
        if len(pool) > 1:
            pool = self._without_slow(pool, first=not exclude)
        if len(pool) == 1:
            return pool[0]
        a, b = self.rng.sample(pool, 2)
        cost_a, cost_b = a.cost(now), b.cost(now)
        if cost_a == cost_b:
            self.ties += 1
            return a if a.load <= b.load else b
        return a if cost_a < cost_b else b

    def _without_slow(self, pool: list[Replica], first: bool) -> list[Replica]:
        """The pool less its slow replicas; or a single slow one, as a probe when one is due."""
        fast = [r for r in pool if not r.slow]
        slow = [r for r in pool if r.slow and r.load == 0]
        if first and slow:
            self._probe_credit = min(1.0, self._probe_credit + self.probe_share)
            if self._probe_credit >= 1.0 or not fast:
                self._probe_credit = max(0.0, self._probe_credit - 1.0)
                self.probes += 1
                self.probed = True
                return [self.rng.choice(slow)]
        return fast or pool

    @staticmethod
    def _judge(peers: list[Replica], now: float) -> None:
        """Mark each of a shard's readable replicas slow or not, on their averages (undecayed: an idle
        replica's decayed estimate is no yardstick); one never sampled is not judged, and one with no
        sampled peer is not slow."""
        sampled = [r for r in peers if r.recent_s]
        best_s = min((r.mean_s for r in sampled), default=0.0)
        for r in sampled:
            line = max(SLOW_RATIO * best_s, best_s + SLOW_MARGIN_S)
            slow = len(sampled) > 1 and r.mean_s > line
            if not r.slow:  # a new verdict needs its recent answers slow too, not one spike
                slow = slow and len(r.recent_s) == SLOW_SAMPLES and min(r.recent_s) > line
            if r.slow and not slow:
                r.sampled_at = now  # its estimate decays from here, not from its last answer
            r.slow = slow
