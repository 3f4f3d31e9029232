"""A deterministic model of the search scatter under a slowed replica, on virtual time.

The very policy objects the front end uses (ReplicaChooser, HedgePolicy, Replica's latency estimate) are
driven the way kinds/search/scatter.py drives them: per shard request, choose a replica, hedge to a second one
when `HedgePolicy.delay_s` has passed (within the budget), take the first answer, forget the other
call (an answered call updates the estimate, an abandoned one is a lower bound). Each replica is one
worker process: a FIFO server that keeps working on calls the front end has given up on. A search is
answered when every shard has answered; its latency is the slowest shard's.

The slow fault is the one `inferd bench-search --slow-factor F` injects: the replica runs `period/F` in
every `period` (SIGCONT/SIGSTOP), so its work goes F times slower and a call that lands as it stops waits
most of a period. Run as a script for the table in docs/search.md:

    PYTHONPATH=src python -m tests.search_fault_model
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

from inferd.clock import FakeClock
from inferd.kinds.search import replicas
from inferd.kinds.search.hedge import HedgePolicy
from inferd.kinds.search.replicas import Replica, ReplicaChooser, ReplicaPhase
from inferd.wire.connection import WorkerState


@dataclass(frozen=True)
class Scenario:
    rate: float = 100.0
    """Searches per second (Poisson)."""
    duration_s: float = 20.0
    shards: int = 2
    replicas: int = 2
    work_median_s: float = 0.0025
    """A shard call's work on a replica (log-normal)."""
    work_sigma: float = 0.6
    slow_factor: float = 10.0
    """The first replica of shard 0 runs 1/F of the time between slow_at_s and slow_at_s + slow_s;
    1 is fault-free."""
    slow_at_s: float = 3.0
    slow_s: float = 15.0
    period_s: float = 0.05
    seed: int = 0


@dataclass(frozen=True)
class Outcome:
    searches: int
    p50_s: float
    p99_s: float
    max_s: float
    requests: int
    hedges: int
    slow_share: float
    """Share of shard 0's first requests that went to the slowed replica while slowed."""
    recovered_share: float
    """...and once the fault is over (its fair share is 1/replicas)."""

    @property
    def hedge_share(self) -> float:
        return self.hedges / max(1, self.requests)


@dataclass(eq=False)
class Server:
    """One replica's worker process: calls run one at a time, in order."""

    duty: tuple[float, float, float] | None = None
    """(start, end, phase) of the duty-cycled window, or None."""
    period_s: float = 0.05
    run_s: float = 0.05
    free_at: float = 0.0

    def finish(self, now: float, work_s: float) -> float:
        start = max(now, self.free_at)
        self.free_at = self.finished(start, work_s)
        return self.free_at

    def finished(self, start: float, work_s: float) -> float:
        """When `work_s` of running time, begun at `start`, is done (stopped time does not count)."""
        if self.duty is None:
            return start + work_s
        begin, end, phase = self.duty
        t = start
        while work_s > 1e-12:
            if t >= end:
                return t + work_s
            if t < begin:
                step = min(work_s, begin - t)
                t, work_s = t + step, work_s - step
                continue
            into = (t - begin - phase) % self.period_s
            if into < self.run_s - 1e-9:  # running
                step = min(work_s, self.run_s - into, end - t)
                t, work_s = t + step, work_s - step
            else:  # stopped until the next cycle (or the end of the fault)
                t = min(t + max(1e-9, self.period_s - into), end)
        return t


@dataclass(eq=False)
class ShardRequest:
    shard: int
    search: Search
    calls: dict[int, tuple[Replica, float]] = field(default_factory=dict)
    hedged: bool = False
    done: bool = False
    probe: bool = False
    """The chooser made its first request a probe of a slow replica."""


@dataclass(eq=False)
class Search:
    arrived: float
    left: int
    answered: float = 0.0


class Model:
    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.rng = random.Random(scenario.seed)
        self.clock = FakeClock(0.0)
        self.hedge = HedgePolicy(self.clock, scenario.shards)
        self.chooser = ReplicaChooser(random.Random(scenario.seed + 1))
        self.replicas = [
            [self._replica(s, i) for i in range(scenario.replicas)] for s in range(scenario.shards)
        ]
        self.servers: dict[Replica, Server] = {r: Server() for rs in self.replicas for r in rs}
        slow = self.replicas[0][0]
        if scenario.slow_factor > 1:
            phase = self.rng.uniform(0, scenario.period_s)
            end = scenario.slow_at_s + scenario.slow_s
            self.servers[slow] = Server(
                (scenario.slow_at_s, end, phase), scenario.period_s, scenario.period_s / scenario.slow_factor
            )
        self.slow = slow
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.call_ids = itertools.count()
        self.latencies: list[float] = []
        self.first_to_slow = self.first_shard0 = self.first_after = self.after_to_slow = 0

    @staticmethod
    def _replica(shard: int, i: int) -> Replica:
        conn = SimpleNamespace(worker_id=f"s{shard}r{i}", state=WorkerState.READY)
        return Replica(conn, shard, ReplicaPhase.SERVING)  # type: ignore[arg-type]

    def at(self, t: float, kind: str, what: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, what))

    def run(self) -> Outcome:
        t = 0.0
        while True:
            t += self.rng.expovariate(self.s.rate)
            if t >= self.s.duration_s:
                break
            self.at(t, "search", None)
        while self.events:
            t, _, kind, what = heapq.heappop(self.events)
            self.clock.advance(max(0.0, t - self.clock.now()))  # float rounding: never backwards
            getattr(self, f"on_{kind}")(what)
        return self.outcome()

    def on_search(self, _: object) -> None:
        search = Search(self.clock.now(), self.s.shards)
        for shard in range(self.s.shards):
            self.ask(ShardRequest(shard, search))

    def ask(self, req: ShardRequest) -> None:
        now = self.clock.now()
        replica = self.chooser.choose(self.replicas[req.shard], 0, set(), now)
        assert replica is not None
        req.probe = self.chooser.probed
        self.hedge.started()
        if req.shard == 0:
            after = now >= self.s.slow_at_s + self.s.slow_s
            if self.s.slow_at_s <= now or after:
                self.first_shard0 += not after
                self.first_to_slow += replica is self.slow and not after
                self.first_after += after
                self.after_to_slow += replica is self.slow and after
        self.send(req, replica)
        self.at(now + self.hedge_delay(req), "hedge", req)

    def hedge_delay(self, req: ShardRequest) -> float:
        return self.hedge.delay_s(req.shard, req.probe)

    def send(self, req: ShardRequest, replica: Replica) -> None:
        now = self.clock.now()
        call_id = next(self.call_ids)
        replica.pending[call_id] = req  # type: ignore[assignment]
        req.calls[call_id] = (replica, now)
        work = self.s.work_median_s * math.exp(self.rng.gauss(0, self.s.work_sigma))
        self.at(self.servers[replica].finish(now, work), "answer", (req, call_id))

    def on_hedge(self, req: ShardRequest) -> None:
        if req.done or req.hedged:
            return
        req.hedged = True
        tried = {r for r, _ in req.calls.values()}
        replica = self.chooser.choose(self.replicas[req.shard], 0, tried, self.clock.now())
        if replica is not None and self.hedge.try_hedge(req.probe):
            self.send(req, replica)

    def on_answer(self, what: tuple[ShardRequest, int]) -> None:
        req, call_id = what
        if req.done:
            return  # forgotten: the other copy answered
        now = self.clock.now()
        replica, sent = req.calls.pop(call_id)
        replica.pending.pop(call_id)
        self.hedge.observe(req.shard, now - sent)
        replica.observe(now - sent, now)
        req.done = True
        for other_id, (other, other_sent) in req.calls.items():
            other.pending.pop(other_id)
            other.observe(now - other_sent, now, lower_bound=True)
        req.search.left -= 1
        if req.search.left == 0:
            self.latencies.append(now - req.search.arrived)

    def outcome(self) -> Outcome:
        lat = sorted(self.latencies)
        n = len(lat)
        return Outcome(
            n,
            lat[int(0.50 * (n - 1))],
            lat[int(0.99 * (n - 1))],
            lat[-1],
            self.hedge.requests,
            self.hedge.hedges,
            self.first_to_slow / max(1, self.first_shard0),
            self.after_to_slow / max(1, self.first_after),
        )


def simulate(scenario: Scenario) -> Outcome:
    return Model(scenario).run()


def pooled(seeds: range, **scenario: float) -> tuple[float, float]:
    """The p99 search latency over every seed's searches, and the share of extra shard requests."""
    latencies: list[float] = []
    requests = hedges = 0
    for seed in seeds:
        model = Model(Scenario(seed=seed, **scenario))  # type: ignore[arg-type]
        model.run()
        latencies += model.latencies
        requests, hedges = requests + model.hedge.requests, hedges + model.hedge.hedges
    latencies.sort()
    return latencies[int(0.99 * (len(latencies) - 1))], hedges / max(1, requests)


def main() -> None:
    print("seed  fault-free p99 ms, hedges  slowed p99 ms, hedges  ratio  to the slow one: during, after")
    for seed in range(8):
        base = simulate(Scenario(slow_factor=1, seed=seed))
        slow = simulate(Scenario(seed=seed, duration_s=28.0))
        print(
            f"{seed:4d}  {base.p99_s * 1e3:17.1f} {base.hedge_share:6.1%}  {slow.p99_s * 1e3:13.1f} {slow.hedge_share:6.1%}"
            f"  {slow.p99_s / base.p99_s:5.2f}  {slow.slow_share:15.1%} {slow.recovered_share:6.1%}"
        )
    seeds = range(8)
    for rate in (100.0, 200.0):
        base, base_extra = pooled(seeds, slow_factor=1, rate=rate)
        slow, slow_extra = pooled(seeds, rate=rate)
        gone, _ = pooled(seeds, slow_factor=1000, rate=rate)
        ratio, replicas.SLOW_RATIO = replicas.SLOW_RATIO, math.inf
        try:
            unjudged, _ = pooled(seeds, rate=rate)
        finally:
            replicas.SLOW_RATIO = ratio
        print(
            f"{rate:g}/s, 8 seeds pooled: fault-free p99 {base * 1e3:.1f} ms ({base_extra:.1%} hedges); "
            f"slowed {slow * 1e3:.1f} ({slow / base:.2f}x, {slow_extra:.1%}); slowed 1000x {gone * 1e3:.1f} "
            f"({gone / base:.2f}x); without the slow verdict {unjudged * 1e3:.1f} ({unjudged / base:.2f}x)"
        )


if __name__ == "__main__":
    main()
