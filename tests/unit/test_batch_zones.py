"""A batch model's zone routing (kinds/batch/worker_choice.py with routing/locality.py): batches go to the
front end's zone while it is healthy, wait for a busy local worker and spill to another zone only when
the local zone is short of capacity (after the batching wait and a batch's time), keep an ejected worker's
zone share, move at once when the local zone is lost and come back after the failback
ramp; a front end without a zone routes as before. What went where is on /metrics."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from inferd.clock import FakeClock
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.kinds.collectors import zone_families
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.health import Health
from inferd.routing.locality import LocalityPolicy
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection
from tests.fakes.worker import FakeWriter, fake_connection


def runtime(zone: str | None, fleet: dict[str, int], max_batch: int = 2, wait_ms: float = 10.0) -> ModelRuntime:
    clock = FakeClock()
    rt = ModelRuntime(
        sim_config(max_batch_size=max_batch, max_wait_ms=wait_ms, idempotent=True),
        clock,
        Metrics().for_model("sim"),
        RetryBudget(clock),
        kill_worker=lambda w: None,
        locality=LocalityPolicy(clock, zone, failback_s=10.0, hold_s=5.0),
    )
    pid = 100
    for z, n in fleet.items():
        for i in range(n):
            conn = fake_connection(f"{z}-{i}.1", pid)
            conn.zone = z or None
            rt.add_worker(conn)
            pid += 1
    return rt


def clock_of(rt: ModelRuntime) -> FakeClock:
    assert isinstance(rt.clock, FakeClock)
    return rt.clock


def by_id(rt: ModelRuntime) -> dict[str, WorkerConnection]:
    return {w.worker_id: w for w in rt.members.connections()}


def answer_all(rt: ModelRuntime) -> Counter[str]:
    """Every batch in flight answered; returns the zone of each batch's worker, counted."""
    zones: Counter[str] = Counter()
    for w in list(rt.members.connections()):
        while w.inflight:
            batch = next(iter(w.inflight.values()))
            zones[w.zone or ""] += 1
            rt.on_batch_done(w, p.BatchDone(batch.batch_id, 0.01, outputs=[{"o": 0}] * len(batch.items)))
    return zones


def run_full_batches(rt: ModelRuntime, batches: int) -> Counter[str]:
    """`batches` full batches, one at a time, each answered before the next: where each ran."""
    zones: Counter[str] = Counter()
    for _ in range(batches):
        rt.enqueue([b"x"] * rt.config.max_batch_size, None)
        rt.dispatch_due()
        zones += answer_all(rt)
        clock_of(rt).advance(0.05)
    return zones


async def test_batches_stay_in_the_front_ends_zone_while_it_is_healthy() -> None:
    rt = runtime("a", {"a": 2, "b": 2})
    assert run_full_batches(rt, 40) == {"a": 40}
    for _ in range(2):  # two full batches at once: both local workers, none remote
        rt.enqueue([b"x", b"y"], None)
    rt.dispatch_due()
    assert sorted(w.worker_id for w in rt.members.connections() if w.inflight) == ["a-0.1", "a-1.1"]


async def test_a_front_end_or_workers_without_a_zone_route_as_before() -> None:
    for rt in (runtime(None, {"a": 2, "b": 2}), runtime("a", {"": 4})):
        for _ in range(4):  # four full batches at once: every worker takes one (p2c among the idle)
            rt.enqueue([b"x", b"y"], None)
        rt.dispatch_due()
        assert all(w.inflight for w in rt.members.connections())
        assert rt.statistics().locality is not None and not rt.statistics().locality.active
        assert zone_families([rt.statistics()]) == []  # nor on /metrics


async def test_a_busy_local_worker_keeps_the_work_until_its_zone_is_short_then_it_spills() -> None:
    """The local worker is busy but its zone is not short of capacity: the work waits for it however long
    another zone's worker idles. Once the queue is past half its bound (admission would soon refuse), it
    spills, after its batching wait (no batch measured yet: the floor is the batching wait alone)."""
    rt = runtime("a", {"a": 1, "b": 1})  # batches of 2, a queue of 8
    clock = clock_of(rt)
    workers = by_id(rt)
    rt.enqueue([b"1", b"2"], None)
    rt.enqueue([b"3", b"4"], None)
    rt.dispatch_due()  # one runs on a-0, the next is staged behind it
    assert len(workers["a-0.1"].inflight) == 2 and not workers["b-0.1"].inflight
    rt.enqueue([b"5"], None)
    assert rt.dispatch_due() is None  # not short: no time to look again at, only a queue length
    assert rt._state.wake_queued == 4
    clock.advance(1.0)
    rt.dispatch_due()
    assert not workers["b-0.1"].inflight  # a second on: still waiting for its own zone
    rt.enqueue([b"6", b"7", b"8"], None)  # 4 queued: half the bound
    wake_at = rt.dispatch_due()
    assert len(workers["b-0.1"].inflight) == 1  # the oldest waited past its floor: spills to zone b
    assert wake_at is None or wake_at > clock.now()
    zones = {z.zone: z for z in rt.statistics().locality.zones}
    assert (zones["a"].served, zones["b"].served, zones["b"].spilled) == (4, 2, 2)


async def test_a_short_zones_work_spills_after_its_floor_a_batchs_time_more_once_measured() -> None:
    """Below its capacity a zone's worker frees within a batch's time: even a short zone's work waits that
    long (plus its batching wait) for one before it spills."""
    rt = runtime("a", {"a": 1, "b": 1})
    clock = clock_of(rt)
    workers = by_id(rt)
    rt.enqueue([b"0", b"0"], None)
    rt.dispatch_due()
    (batch,) = workers["a-0.1"].inflight.values()
    clock.advance(0.05)
    rt.on_batch_done(workers["a-0.1"], p.BatchDone(batch.batch_id, 0.05, outputs=[{"o": 0}] * 2))
    assert rt.estimator.batch_latency_s == pytest.approx(0.05)
    rt.enqueue([b"1", b"2"], None)
    rt.enqueue([b"3", b"4"], None)
    rt.dispatch_due()  # a-0 runs one and holds the next
    rt.enqueue([b"5", b"6"], None)
    rt.enqueue([b"7", b"8"], None)  # 4 queued: short
    wake_at = rt.dispatch_due()
    assert not workers["b-0.1"].inflight
    assert wake_at is not None and wake_at <= clock.now() + 0.010 + 0.05 + 1e-9  # looks again by then
    clock.advance(0.055)
    rt.dispatch_due()
    assert not workers["b-0.1"].inflight
    clock.advance(0.005)
    rt.dispatch_due()
    assert len(workers["b-0.1"].inflight) == 1


async def test_a_deadline_nearing_makes_a_zone_short() -> None:
    """Clearing the queue would take more than half of the oldest item's remaining deadline: it spills
    (the dispatcher looks again then, not only at the next event)."""
    rt = runtime("a", {"a": 1, "b": 1})
    clock = clock_of(rt)
    workers = by_id(rt)
    rt.enqueue([b"0", b"0"], None)
    rt.dispatch_due()
    (batch,) = workers["a-0.1"].inflight.values()
    clock.advance(0.05)
    rt.on_batch_done(workers["a-0.1"], p.BatchDone(batch.batch_id, 0.05, outputs=[{"o": 0}] * 2))
    rt.enqueue([b"1", b"2"], None)
    rt.enqueue([b"3", b"4"], None)
    rt.dispatch_due()  # a-0 runs one and holds the next
    rt.enqueue([b"5"], clock.now() + 1.0)  # 1 batch to clear: 0.05 s, half of what is left at 0.9 s
    spill_at = clock.now() + 0.9
    while (wake_at := rt.dispatch_due()) is not None and wake_at < spill_at - 1e-9:
        assert not workers["b-0.1"].inflight
        clock.advance(wake_at - clock.now())
    assert wake_at == pytest.approx(spill_at) and not workers["b-0.1"].inflight  # looks again then
    clock.advance(spill_at - clock.now())
    rt.dispatch_due()
    assert len(workers["b-0.1"].inflight) == 1


async def test_an_ejected_one_worker_zone_keeps_its_share_and_its_work_spills_meanwhile() -> None:
    """The ejector's verdict steers the work, but is no zone health: the share stays (no failback hold
    and ramp after the ejection) while the zone's work goes to another zone at once."""
    rt = runtime("a", {"a": 1, "b": 1})
    clock = clock_of(rt)
    workers = by_id(rt)
    assert run_full_batches(rt, 3) == {"a": 3}
    for _ in range(rt.ejector.consecutive_failures):  # failed batches in a row eject it
        rt.ejector.failure("a-0.1")
    assert rt.ejector.health("a-0.1") is Health.EJECTED
    assert run_full_batches(rt, 3) == {"b": 3}  # at once, no floor
    assert rt.statistics().locality.local_share == 1.0
    clock.advance(60.0)  # the ejection is over
    assert run_full_batches(rt, 5) == {"a": 5}  # back at once: no hold, no ramp
    assert not workers["b-0.1"].inflight


async def test_losing_the_local_zone_moves_the_work_at_once_and_it_comes_back_after_the_ramp() -> None:
    rt = runtime("a", {"a": 2, "b": 2})
    clock = clock_of(rt)
    assert run_full_batches(rt, 10) == {"a": 10}
    workers = by_id(rt)
    for wid in ("a-0.1", "a-1.1"):
        rt.on_worker_lost(workers[wid], "cut off")
    assert run_full_batches(rt, 10) == {"b": 10}  # at once, with no wait
    clock.advance(30.0)
    for i, wid in enumerate(("a-0.1", "a-1.1")):  # healed: the same workers join again
        conn = fake_connection(wid, 200 + i)
        conn.zone = "a"
        rt.add_worker(conn)
    ramp = [run_full_batches(rt, 10)["a"] for _ in range(40)]  # 10 batches every 0.5 s
    assert ramp[:10] == [0] * 10  # held for 5 s
    assert ramp[-4:] == [10] * 4  # all local again after the 10 s ramp
    assert ramp == sorted(ramp) and 0 < ramp[15] < 10  # gradually, never back down


async def test_the_in_zone_share_is_on_metrics() -> None:
    rt = runtime("a", {"a": 2, "b": 1})
    run_full_batches(rt, 3)
    registry = CollectorRegistry()

    class Zones:
        def collect(self) -> list[object]:
            return zone_families([rt.statistics()])

    registry.register(Zones())  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'inferd_requests_by_zone_total{local="true",model="sim",version="1",zone="a"} 6.0' in text
    assert 'inferd_requests_by_zone_total{local="false",model="sim",version="1",zone="b"} 0.0' in text
    assert 'inferd_zone_share{local="true",model="sim",version="1",zone="a"} 1.0' in text
    assert 'inferd_requests_spilled_by_zone_total{local="false",model="sim",version="1",zone="b"} 0.0' in text


def demands(conn: WorkerConnection) -> list[p.Demand]:
    """The Demand messages the front end sent the worker."""
    writer = conn.writer
    assert isinstance(writer, FakeWriter)
    return [m for f in writer.frames if isinstance(m := p.decode_message(f[4:]), p.Demand)]


async def test_a_front_end_asks_another_zones_shared_workers_for_slots_only_once_its_zone_is_short() -> None:
    """A slot of another zone's shared worker held unused is one less for that zone's own front end: the
    front end gives such slots back, and asks for them only while its zones with a share are short."""
    rt = runtime("a", {"a": 1, "b": 1})  # batches of 2, a queue of 8
    workers = by_id(rt)
    for w in workers.values():  # shared, credited, busy with another front end's batch
        w.credits, w.shared, w.worker_idle = 0, True, False
    workers["b-0.1"].credits = 1  # zone b's worker granted this front end a slot
    rt.enqueue([b"1"], None)
    rt.dispatch_due()
    rt.report_demand()
    assert demands(workers["a-0.1"]) == [p.Demand(1, 0.0)]  # its own zone's: asked
    assert demands(workers["b-0.1"]) == [p.Demand(0, 0.0, returned=1)]  # zone b's: given back
    assert workers["b-0.1"].credits == 0 and not workers["b-0.1"].inflight
    rt.enqueue([b"2", b"3", b"4"], None)  # 4 queued, half the bound: short
    rt.dispatch_due()
    rt.report_demand()
    assert demands(workers["b-0.1"])[-1] == p.Demand(4, 0.0)  # now asked too


async def test_a_front_end_whose_zone_is_lost_asks_another_zones_shared_workers_at_once() -> None:
    """Its own zone's shared worker lost and no slot held anywhere (no worker is free, so no batch computed
    the shares since): the slots it asks for are those of the zones with a share now, zone b's, not those
    of the zones the shares gave the work to before the loss (its work would wait for a zone with no
    worker)."""
    rt = runtime("a", {"a": 1, "b": 1})
    workers = by_id(rt)
    for w in workers.values():  # shared, credited, busy with another front end's batch
        w.credits, w.shared, w.worker_idle = 0, True, False
    workers["b-0.1"].credits = 1
    rt.enqueue([b"1"], None)
    rt.dispatch_due()
    rt.report_demand()
    assert demands(workers["b-0.1"]) == [p.Demand(0, 0.0, returned=1)]  # zone a has the share: given back
    rt.on_worker_lost(workers["a-0.1"], "cut off")
    rt.dispatch_due()
    rt.report_demand()
    assert demands(workers["b-0.1"])[-1] == p.Demand(1, 0.0)  # asked at once


async def test_without_zones_the_dispatcher_computes_no_backlog_for_the_load_spill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request path pays nothing for zones it does not have: the backlog the load spill reads is not
    computed on a front end without a zone, nor on one whose workers have none."""
    from inferd.kinds.batch.dispatch import Dispatcher

    def refuse(self: Dispatcher, now: float) -> None:
        raise AssertionError("backlog computed without zones")

    for rt in (runtime(None, {"a": 1, "b": 1}), runtime("a", {"": 2})):
        monkeypatch.setattr(Dispatcher, "_backlog", refuse)
        for _ in range(3):
            rt.enqueue([b"x", b"y"], None)
        rt.dispatch_due()
        rt.report_demand()
        assert sum(len(w.inflight) for w in rt.members.connections()) == 3
        monkeypatch.undo()
    zoned = runtime("a", {"a": 1, "b": 1})
    monkeypatch.setattr(Dispatcher, "_backlog", refuse)
    zoned.enqueue([b"x", b"y"], None)
    with pytest.raises(AssertionError, match="backlog computed"):
        zoned.dispatch_due()
