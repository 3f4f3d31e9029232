"""An LLM model's zone routing (kinds/llm/placement.py with routing/locality.py): sequences go to the front
end's zone while it is healthy, prefix affinity applies within that zone first, a zone whose workers have
no room spills to the next instead of refusing, a lost zone's work moves at once and comes back after the
failback ramp; a front end or workers without a zone route as before."""

from __future__ import annotations

from collections import Counter

import pytest

from inferd.clock import FakeClock
from inferd.errors import Overloaded
from inferd.kinds.llm.placement import Generation
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.sim_llm import sim_llm_config
from inferd.routing.locality import LocalityPolicy
from inferd.wire.connection import WorkerConnection
from tests.unit.test_llm_failover import RecordingWriter, step


def make_runtime(
    zone: str | None, fleet: dict[str, int], scheduler: dict | None = None
) -> tuple[LLMRuntime, dict[str, WorkerConnection]]:
    clock = FakeClock()
    params = {"scheduler": {"block_size": 4, **(scheduler or {})}}
    locality = LocalityPolicy(clock, zone, failback_s=10.0, hold_s=5.0)
    rt = LLMRuntime(sim_llm_config(params=params), clock, kill_worker=lambda w: None, locality=locality)
    workers = {}
    pid = 100
    for z, n in fleet.items():
        for i in range(n):
            workers[f"{z}-{i}"] = join(rt, f"{z}-{i}", z or None, pid)
            pid += 1
    return rt, workers


def join(rt: LLMRuntime, worker_id: str, zone: str | None, pid: int) -> WorkerConnection:
    w = WorkerConnection(worker_id, "sim-llm", pid, "h", RecordingWriter())  # type: ignore[arg-type]
    w.zone = zone
    rt.add_worker(w)
    return w


def zone_of(workers: dict[str, WorkerConnection], worker_id: str) -> str:
    return workers[worker_id].zone or ""


def finish_all(rt: LLMRuntime, workers: dict[str, WorkerConnection]) -> None:
    for live in list(rt.placement.live.values()):
        step(rt, workers[live.stream.worker_id], {live.stream.seq_id: [1]}, finish="stop")


def test_sequences_stay_in_the_front_ends_zone_and_affinity_applies_within_it() -> None:
    rt, workers = make_runtime("a", {"a": 2, "b": 2})
    prefix = list(range(40))
    seen = Counter()
    for i in range(20):
        s = rt.submit([*prefix, i], Generation(max_tokens=4, tenant="t"))
        seen[s.worker_id] += 1
        finish_all(rt, workers)
    assert len(seen) == 1 and set(seen) <= {"a-0", "a-1"}  # the one local worker that holds the prefix
    others = Counter(rt.submit([i, i], Generation(max_tokens=4)).worker_id for i in range(20))
    assert set(others) == {"a-0", "a-1"}  # short prompts: least loaded, within the zone
    stats = rt.statistics().locality
    assert stats is not None and stats.active and stats.local_share == 1.0
    assert {z.zone: z.served for z in stats.zones} == {"a": 40, "b": 0}


def test_a_prefix_cached_in_another_zone_does_not_pull_work_out_of_the_local_one() -> None:
    rt, workers = make_runtime("a", {"a": 1, "b": 1}, scheduler={"max_waiting_seqs": 1})
    prefix = list(range(40))
    assert rt.submit([9, 9, 9], Generation(max_tokens=4, tenant="t")).worker_id == "a-0"
    assert rt.submit([*prefix, 1], Generation(max_tokens=4, tenant="t")).worker_id == "b-0"  # a-0 full: spill
    finish_all(rt, workers)
    assert rt.submit([*prefix, 2], Generation(max_tokens=4, tenant="t")).worker_id == "a-0"  # zone first


def test_a_full_zone_spills_to_the_next_instead_of_refusing() -> None:
    rt, _ = make_runtime("a", {"a": 1, "b": 1}, scheduler={"max_waiting_seqs": 2})
    placed = [rt.submit([1, 2, 3], Generation(max_tokens=4)).worker_id for _ in range(4)]
    assert placed == ["a-0", "a-0", "b-0", "b-0"]  # a-0's engine queue is full after two
    with pytest.raises(Overloaded):  # both full: 429, as without zones
        rt.submit([1, 2, 3], Generation(max_tokens=4))
    zones = {z.zone: z for z in rt.statistics().locality.zones}
    assert (zones["a"].served, zones["b"].served, zones["b"].spilled) == (2, 2, 2)


def test_a_lost_zone_moves_work_at_once_and_it_comes_back_gradually() -> None:
    rt, workers = make_runtime("a", {"a": 2, "b": 2})
    clock = rt.clock
    assert isinstance(clock, FakeClock)
    for wid in ("a-0", "a-1"):
        rt.on_worker_lost(workers[wid], "cut off")
    assert {zone_of(workers, rt.submit([i], Generation(max_tokens=2)).worker_id) for i in range(10)} == {"b"}
    finish_all(rt, workers)
    clock.advance(30.0)
    for i, wid in enumerate(("a-0", "a-1")):  # healed
        workers[wid] = join(rt, wid, "a", 300 + i)
    local = []
    for _ in range(40):  # 10 sequences every 0.5 s
        placed = [rt.submit([i], Generation(max_tokens=2)).worker_id for i in range(10)]
        local.append(sum(zone_of(workers, w) == "a" for w in placed))
        finish_all(rt, workers)
        clock.advance(0.5)
    assert local[:10] == [0] * 10  # held 5 s
    assert local[-4:] == [10] * 4  # all local after the ramp
    assert local == sorted(local) and 0 < local[15] < 10


def test_a_front_end_or_workers_without_a_zone_route_as_before() -> None:
    for zone, fleet in ((None, {"a": 2, "b": 2}), ("a", {"": 4})):
        rt, _ = make_runtime(zone, fleet)
        placed = Counter(rt.submit([i, i], Generation(max_tokens=4)).worker_id for i in range(8))
        assert sorted(placed.values()) == [2, 2, 2, 2]  # least loaded over every worker
        assert not rt.statistics().locality.active
