"""PoolManager (pools/manager.py) against fake pool workers over socket pairs: the Welcome, PoolState
kept, loads placed on wake, LoadResult (ok: measured, eta; failed: waiting requests failed with the
cause, backoff), unload, silent links cut, and the metrics it feeds."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from inferd.cli.pool_status import pools_parts
from inferd.clock import FakeClock
from inferd.config import ModelConfig
from inferd.config.pools import PoolConfig
from inferd.errors import ServingError, WorkerUnavailable
from inferd.pools import manager
from inferd.pools.manager import PoolManager, ServedModel
from inferd.pools.metrics import PoolMetrics
from inferd.wire import protocol as p

TENSORS = {"inputs": [{"name": "x", "datatype": "FP32"}], "outputs": [{"name": "y", "datatype": "FP32"}]}


def config(name: str, memory: float = 300.0) -> ModelConfig:
    return ModelConfig(
        name=name, implementation="inferd.models.sim:SimModel", pool="p", memory_mb=memory, **TENSORS
    )


@dataclass
class Fixture:
    manager: PoolManager
    clock: FakeClock
    registry: CollectorRegistry
    served: list[ServedModel]
    failed: list[tuple[str, int, ServingError]] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


@dataclass
class FakeWorker:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    welcome: p.Welcome

    def send(self, msg: p.Message) -> None:
        self.writer.write(p.encode_frame(msg))

    async def receive(self) -> p.Message:
        async with asyncio.timeout(5.0):
            return await p.read_message(self.reader)


@pytest.fixture
async def pool() -> AsyncIterator[Fixture]:
    clock = FakeClock()
    registry = CollectorRegistry()
    served: list[ServedModel] = []
    fixture: Fixture
    manager = PoolManager(
        "p",
        PoolConfig(workers=0, memory_budget_mb=1000.0),
        clock,
        lambda: list(served),
        lambda m, v: next((s.config for s in served if (s.config.name, s.config.version) == (m, v)), None),
        lambda m, v, exc: fixture.failed.append((m, v, exc)),
        PoolMetrics(registry),
    )
    fixture = Fixture(manager, clock, registry, served)
    yield fixture
    manager.close()
    for task in fixture.tasks:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def join(fixture: Fixture, worker_id: str, pid: int = 7) -> FakeWorker:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    w_reader, w_writer = await asyncio.open_connection(sock=theirs)
    hello = p.Hello(worker_id=worker_id, model="", pid=pid, host="h", pool="p")
    fixture.tasks.append(asyncio.create_task(fixture.manager.serve(hello, reader, writer)))
    async with asyncio.timeout(5.0):
        welcome = await p.read_message(w_reader)
    assert isinstance(welcome, p.Welcome)
    return FakeWorker(w_reader, w_writer, welcome)


async def settle(fixture: Fixture, check: object) -> None:
    """Until `check()` holds (the manager has read what a fake worker sent)."""
    async with asyncio.timeout(5.0):
        while not check():  # type: ignore[operator]  # noqa: ASYNC110 - the manager's state, read from its links
            await asyncio.sleep(0.005)


async def test_a_pool_link_is_welcomed_with_the_pools_settings(pool: Fixture) -> None:
    worker = await join(pool, "w0")
    assert worker.welcome.accepted
    assert PoolConfig.model_validate_json(worker.welcome.pool_config_json) == pool.manager.config
    assert list(pool.manager.links) == ["w0"]


async def test_a_wake_loads_the_model_on_the_roomiest_worker(pool: Fixture) -> None:
    w0, w1 = await join(pool, "w0"), await join(pool, "w1")
    w0.send(p.PoolState(budget_mb=1000.0, used_mb=600.0))
    w1.send(p.PoolState(budget_mb=1000.0, used_mb=100.0))
    await settle(pool, lambda: all(link.state is not None for link in pool.manager.links.values()))
    pool.served.append(ServedModel(config("a"), waiting=0, serving=0, batch_cycle_s=0.0))
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)
    msg = await w1.receive()
    assert isinstance(msg, p.LoadModel) and (msg.model, msg.version) == ("a", 1)
    assert ModelConfig.model_validate_json(msg.config_json).memory_mb == 300.0
    assert msg.wait_s == 30.0  # the model's default timeout
    pool.manager.wake("a", 1, waiting=3, oldest_age_s=0.5)  # asked again while it loads: nothing more
    assert pool.manager.placement.pending("a", 1) == "w1"
    w1.send(p.LoadResult("a", 1, ok=True, load_s=0.4, memory_mb=280.0))
    await settle(pool, lambda: pool.manager.eta_s("a", 1) is not None)
    assert pool.manager.eta_s("a", 1) == 0.4
    assert pool.manager.size_mb(config("a")) == 280.0  # measured replaces the estimate
    assert pool.manager.placement.pending("a", 1) is None


async def test_a_failed_load_fails_the_waiting_requests_and_backs_off(pool: Fixture) -> None:
    w0 = await join(pool, "w0")
    pool.served.append(ServedModel(config("a"), waiting=2, serving=0, batch_cycle_s=0.0))
    pool.manager.wake("a", 1, waiting=2, oldest_age_s=0.0)
    assert isinstance(await w0.receive(), p.LoadModel)
    w0.send(p.LoadResult("a", 1, ok=False, error="ImportError: no module named nope"))
    await settle(pool, lambda: pool.failed)
    [(model, version, exc)] = pool.failed
    assert (model, version) == ("a", 1)
    assert "no module named nope" in str(exc) and exc.retry_after_s == 1.0  # type: ignore[attr-defined]
    reason = pool.manager.wakeable("a", 1)
    assert isinstance(reason, WorkerUnavailable) and reason.retry_after_s == 1.0  # the backoff left
    assert "no module named nope" in str(reason) and "next try is in 1.0 s" in str(reason)
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)  # within the backoff: no load
    assert pool.manager.placement.pending("a", 1) is None
    pool.clock.advance(1.5)
    assert pool.manager.wakeable("a", 1) is None
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)
    assert isinstance(await w0.receive(), p.LoadModel)


async def test_a_worker_lost_twice_while_loading_fails_the_waiting_requests(pool: Fixture) -> None:
    pool.served.append(ServedModel(config("a"), waiting=1, serving=0, batch_cycle_s=0.0))
    for attempt in range(2):
        w0 = await join(pool, "w0")
        pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)
        assert isinstance(await w0.receive(), p.LoadModel)
        w0.writer.close()  # it died loading "a"
        await settle(pool, lambda: "w0" not in pool.manager.links)
        assert len(pool.failed) == attempt  # the first loss is asked again; the second fails them
    [(model, version, exc)] = pool.failed
    assert (model, version) == ("a", 1) and "pool worker w0 left while loading it" in str(exc)
    assert exc.retry_after_s == 2.0  # type: ignore[attr-defined]


async def test_a_worker_lost_while_it_served_another_model_is_not_blamed_on_the_load(pool: Fixture) -> None:
    """A worker that held another model ready may have been ended by a batch of it (a poisonous input):
    the load lost with it is asked again, its waiting requests are not failed."""
    pool.served.append(ServedModel(config("a"), waiting=1, serving=0, batch_cycle_s=0.0))
    for _ in range(3):
        w0 = await join(pool, "w0")
        w0.send(p.PoolState(1000.0, 300.0, [p.HeldModel("b", 1, "ready", 300.0)]))
        await settle(pool, lambda: pool.manager.links["w0"].state is not None)
        pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)
        assert isinstance(await w0.receive(), p.LoadModel)
        w0.writer.close()
        await settle(pool, lambda: "w0" not in pool.manager.links)
    assert pool.failed == [] and pool.manager.placement.retry_in("a", 1) is None  # no backoff


async def test_a_worker_restarted_under_the_same_id_is_asked_again_and_its_counts_kept(pool: Fixture) -> None:
    """A remote pool worker restarted with the same --worker-id (its host crashed: the old link is not
    closed yet when the new process joins) replaces the old link. The load asked of the old process will
    never be answered: it is asked again of the new one, not left pending for minutes; and the old
    process's load counts stay in the sums (a counter never goes down)."""
    pool.served.append(ServedModel(config("a"), waiting=1, serving=0, batch_cycle_s=0.0))
    old = await join(pool, "w0", pid=7)
    old.send(p.PoolState(1000.0, 0.0, loads={"b": 3}))
    await settle(pool, lambda: pool.manager.links["w0"].state is not None)
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)
    assert isinstance(await old.receive(), p.LoadModel)
    new = await join(pool, "w0", pid=8)  # the restarted process
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)
    msg = await new.receive()
    assert isinstance(msg, p.LoadModel) and msg.model == "a"
    new.send(p.PoolState(1000.0, 0.0, loads={"b": 1}))
    await settle(pool, lambda: pool.manager.links["w0"].state is not None)
    text = generate_latest(pool.registry).decode()
    assert 'inferd_model_loads_total{model="b"} 4.0' in text
    assert text.count('inferd_pool_memory_budget_mb{pool="p",worker="w0"}') == 1
    again = await join(pool, "w0", pid=8)  # the same process again (its link was cut): nothing asked anew
    assert pool.manager.placement.pending("a", 1) == "w0"
    again.send(p.PoolState(1000.0, 0.0, loads={"b": 2}))
    await settle(pool, lambda: pool.manager.links["w0"].state is not None)
    assert 'inferd_model_loads_total{model="b"} 5.0' in generate_latest(pool.registry).decode()


async def test_a_load_with_no_room_waits_for_the_pools_own_workers_to_join(pool: Fixture) -> None:
    pool.manager.config = PoolConfig(workers=2, memory_budget_mb=1000.0)  # two of its own, one joined yet
    w0 = await join(pool, "w0")
    w0.send(p.PoolState(1000.0, 900.0, [p.HeldModel("b", 1, "ready", 900.0)]))
    await settle(pool, lambda: pool.manager.links["w0"].state is not None)
    pool.served.append(ServedModel(config("a"), waiting=1, serving=0, batch_cycle_s=0.0))
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)
    assert pool.manager.placement.pending("a", 1) is None  # not sent to wait at w0
    w1 = await join(pool, "w1")
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)
    msg = await w1.receive()
    assert isinstance(msg, p.LoadModel) and msg.model == "a"


async def test_a_worker_that_never_joins_is_waited_for_a_while_only(pool: Fixture) -> None:
    pool.manager.config = PoolConfig(workers=2, memory_budget_mb=1000.0)
    w0 = await join(pool, "w0")
    w0.send(p.PoolState(1000.0, 900.0, [p.HeldModel("b", 1, "ready", 900.0)]))
    await settle(pool, lambda: pool.manager.links["w0"].state is not None)
    pool.served.append(ServedModel(config("a"), waiting=1, serving=0, batch_cycle_s=0.0))
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)
    assert pool.manager.placement.pending("a", 1) is None
    pool.clock.advance(manager.JOIN_GRACE_S)
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=10.0)  # it waits for room at w0 now
    assert isinstance(await w0.receive(), p.LoadModel)


async def test_a_worker_view_counts_its_models_against_max_loaded_models(pool: Fixture) -> None:
    w0 = await join(pool, "w0")
    assert pool.manager.links["w0"].view(1000.0, 2).slots == 2
    w0.send(p.PoolState(1000.0, 300.0, [p.HeldModel("a", 1, "ready", 200.0), p.HeldModel("b", 1, "loading", 100.0)]))
    await settle(pool, lambda: pool.manager.links["w0"].state is not None)
    assert pool.manager.links["w0"].view(1000.0, 2).slots == 0
    assert pool.manager.links["w0"].view(1000.0, None).slots is None


async def test_unload_tells_every_pool_worker(pool: Fixture) -> None:
    w0, w1 = await join(pool, "w0"), await join(pool, "w1")
    assert sorted(pool.manager.unload("a", 1)) == ["w0", "w1"]
    for worker in (w0, w1):
        msg = await worker.receive()
        assert isinstance(msg, p.UnloadModel) and (msg.model, msg.version) == ("a", 1)


async def test_a_silent_link_is_cut_and_forgotten(pool: Fixture) -> None:
    w0 = await join(pool, "w0")
    pool.clock.advance(4.0)
    w0.send(p.Heartbeat(running=0, completed_batches=0))
    await settle(pool, lambda: pool.manager.links["w0"].last_heard == pool.clock.now())
    pool.manager.tick()
    assert "w0" in pool.manager.links
    pool.clock.advance(6.0)
    pool.manager.tick()
    await settle(pool, lambda: not pool.manager.links)


async def test_a_draining_worker_is_answered_and_gets_no_load(pool: Fixture) -> None:
    w0 = await join(pool, "w0")
    w0.send(p.Drain())
    assert isinstance(await w0.receive(), p.Drain)
    pool.served.append(ServedModel(config("a"), waiting=1, serving=0, batch_cycle_s=0.0))
    assert pool.manager.place() == []


async def test_a_load_a_draining_worker_refuses_is_not_placed_not_failed(pool: Fixture) -> None:
    """The worker says it drains on its pool link (Drain) before it refuses or gives up a load: the load is
    placed again on another worker, the waiting requests are not failed, and no backoff starts."""
    w0, w1 = await join(pool, "w0"), await join(pool, "w1")
    w0.send(p.PoolState(budget_mb=1000.0, used_mb=0.0))
    w1.send(p.PoolState(budget_mb=1000.0, used_mb=500.0))
    await settle(pool, lambda: all(link.state is not None for link in pool.manager.links.values()))
    pool.served.append(ServedModel(config("a"), waiting=1, serving=0, batch_cycle_s=0.0))
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.0)
    assert isinstance(await w0.receive(), p.LoadModel)
    w0.send(p.Drain())
    w0.send(p.LoadResult("a", 1, ok=False, error="pool worker w0 drains"))
    assert isinstance(await w0.receive(), p.Drain)
    await settle(pool, lambda: pool.manager.placement.pending("a", 1) is None)
    assert pool.failed == [] and pool.manager.wakeable("a", 1) is None
    pool.manager.wake("a", 1, waiting=1, oldest_age_s=0.1)
    msg = await w1.receive()
    assert isinstance(msg, p.LoadModel) and msg.model == "a"


async def test_wakeable_and_load_refusal(pool: Fixture) -> None:
    reason = pool.manager.wakeable("a", 1)
    assert isinstance(reason, str) and "pool 'p' has no worker" in reason and "inferd worker --pool p" in reason
    await join(pool, "w0")
    assert pool.manager.wakeable("a", 1) is None
    assert pool.manager.load_refusal(config("a", memory=900.0)) is None
    refusal = pool.manager.load_refusal(config("a", memory=1500.0))
    assert refusal is not None and "1500 MiB" in refusal and "1000 MiB" in refusal


async def test_metrics_sum_every_workers_counters(pool: Fixture) -> None:
    w0, w1 = await join(pool, "w0"), await join(pool, "w1")
    held = [p.HeldModel("a", 1, "ready", 300.0), p.HeldModel("b", 1, "loading", 200.0)]
    w0.send(p.PoolState(1000.0, 500.0, held, loads={"a": 3, "b": 1}, evictions={"a": 2}))
    w1.send(p.PoolState(1000.0, 0.0, [], loads={"a": 1}, evictions={}))
    w1.send(p.LoadResult("a", 1, ok=True, load_s=0.3, memory_mb=300.0))
    await settle(pool, lambda: pool.manager.eta_s("a", 1) is not None and all(
        link.state is not None for link in pool.manager.links.values()))
    text = generate_latest(pool.registry).decode()
    assert 'inferd_model_loads_total{model="a"} 4.0' in text
    assert 'inferd_model_loads_total{model="b"} 1.0' in text
    assert 'inferd_model_evictions_total{model="a"} 2.0' in text
    assert 'inferd_pool_memory_used_mb{pool="p",worker="w0"} 500.0' in text
    assert 'inferd_pool_memory_budget_mb{pool="p",worker="w1"} 1000.0' in text
    assert 'inferd_pool_models_loaded{pool="p",worker="w0"} 1.0' in text
    assert 'inferd_model_load_seconds_count{model="a"} 1.0' in text
    w1.writer.close()  # it leaves: its gauges go, its counts stay
    await settle(pool, lambda: "w1" not in pool.manager.links)
    text = generate_latest(pool.registry).decode()
    assert 'worker="w1"' not in text
    assert 'inferd_model_loads_total{model="a"} 4.0' in text


def test_a_front_end_that_does_not_export_adds_no_families() -> None:
    registry = CollectorRegistry()
    metrics = PoolMetrics(registry, export=False)
    metrics.counted("p", "w0", p.PoolState(1000.0, 10.0, loads={"a": 1}))
    metrics.loaded("a", 0.5)
    assert b"inferd_model_loads" not in generate_latest(registry)


async def test_the_view_and_inferd_status_show_what_each_worker_holds(pool: Fixture) -> None:
    w0 = await join(pool, "w0")
    w0.send(p.PoolState(1000.0, 300.0, [p.HeldModel("a", 1, "ready", 300.0, idle_s=7.0, evictable=True)],
                        waiting_loads=1))
    await settle(pool, lambda: pool.manager.links["w0"].state is not None)
    pool.served.append(ServedModel(config("b"), waiting=4, serving=0, batch_cycle_s=0.0))
    view = pool.manager.view()
    [worker] = view["workers"]
    assert (worker["worker_id"], worker["used_mb"], worker["budget_mb"], worker["waiting_loads"]) == ("w0", 300.0, 1000.0, 1)
    assert worker["models"] == [
        {"model": "a", "version": 1, "state": "ready", "memory_mb": 300.0, "idle_s": 7.0, "evictable": True}
    ]
    console = Console(width=200, record=True)
    for part in pools_parts({"pools": [view]}):
        console.print(part)
    text = console.export_text()
    assert "a v1 ready 300 MiB idle 7.0s evictable" in text
    assert "pool p: model b v1: 4 waiting, 0 serving" in text
    assert pools_parts({"pools": []}) == []


async def test_the_timer_spreads_a_hot_model_to_one_more_worker(pool: Fixture) -> None:
    w0, w1 = await join(pool, "w0"), await join(pool, "w1")
    w0.send(p.PoolState(1000.0, 300.0, [p.HeldModel("a", 1, "ready", 300.0)]))
    w1.send(p.PoolState(1000.0, 0.0))
    await settle(pool, lambda: all(link.state is not None for link in pool.manager.links.values()))
    hot = config("a").model_copy(update={"max_batch_size": 4})
    pool.served.append(ServedModel(hot, waiting=40, serving=1, batch_cycle_s=0.1))  # 10 batches for 1 worker
    pool.manager.tick()  # hot from now on
    assert pool.manager.placement.pending("a", 1) is None
    pool.clock.advance(0.2)
    pool.manager.tick()
    msg = await w1.receive()
    assert isinstance(msg, p.LoadModel) and msg.model == "a"
    pool.clock.advance(0.2)
    pool.manager.tick()  # one load at a time: nothing more while it is in progress
    assert pool.manager.placement.pending("a", 1) == "w1"


async def test_a_load_joined_on_a_ready_model_is_not_a_measured_load(pool: Fixture) -> None:
    w0 = await join(pool, "w0")
    w0.send(p.PoolState(1000.0, 280.0, [p.HeldModel("a", 1, "ready", 280.0)]))
    w0.send(p.LoadResult("a", 1, ok=True, load_s=0.4, memory_mb=280.0))  # it held "a" ready already
    w0.send(p.LoadResult("b", 1, ok=True, load_s=0.7, memory_mb=100.0))  # a load that ended now
    await settle(pool, lambda: pool.manager.eta_s("b", 1) is not None)  # read after a's
    assert pool.manager.size_mb(config("a")) == 280.0 and pool.manager.eta_s("a", 1) is None
    text = generate_latest(pool.registry).decode()
    assert 'inferd_model_load_seconds_count{model="b"} 1.0' in text and 'load_seconds_count{model="a"}' not in text


async def test_a_model_measured_bigger_than_every_budget_is_refused_at_once(pool: Fixture) -> None:
    w0 = await join(pool, "w0")
    pool.served.append(ServedModel(config("a"), waiting=0, serving=0, batch_cycle_s=0.0))
    assert pool.manager.wakeable("a", 1) is None  # its estimate (300 MiB) fits
    w0.send(p.LoadResult("a", 1, ok=True, load_s=0.5, memory_mb=1200.0))  # it measured 1200 MiB somewhere
    await settle(pool, lambda: pool.manager.size_mb(config("a")) == 1200.0)
    reason = pool.manager.wakeable("a", 1)
    assert isinstance(reason, str) and "takes 1200 MiB" in reason and "1000 MiB" in reason


async def test_a_load_queued_on_a_worker_by_another_front_end_is_joined(pool: Fixture) -> None:
    """Another front end asked w0 for "a", and it waits there behind "b" (max_concurrent_loads): its
    PoolState lists it queued, so a wake here asks no other worker for a second copy; it joins w0's."""
    w0, w1 = await join(pool, "w0"), await join(pool, "w1")
    queued = [p.QueuedLoad("a", 1, 300.0)]
    w0.send(p.PoolState(1000.0, 300.0, [p.HeldModel("b", 1, "loading", 300.0)], waiting_loads=1, queued=queued))
    w1.send(p.PoolState(1000.0, 0.0))
    await settle(pool, lambda: all(link.state is not None for link in pool.manager.links.values()))
    view = pool.manager.links["w0"].view(1000.0, max_models=3)
    assert view.held == {("b", 1): "loading", ("a", 1): "queued"}
    assert (view.free_mb, view.slots) == (400.0, 1)  # the queued load's room and slot are taken
    [shown, _] = pool.manager.view()["workers"]  # /admin/pools names it
    assert shown["queued"] == [{"model": "a", "version": 1, "memory_mb": 300.0}]
    pool.served.append(ServedModel(config("a"), waiting=0, serving=0, batch_cycle_s=0.0))
    pool.manager.wake("a", 1, waiting=4, oldest_age_s=0.0)
    pool.manager.tick()
    assert pool.manager.placement.pending("a", 1) == "w0"  # joined there, no copy asked of w1
    w0.send(p.LoadResult("a", 1, ok=False, error="no room within its wait"))  # that load failed
    await settle(pool, lambda: pool.failed)
    assert [(m, v) for m, v, _ in pool.failed] == [("a", 1)]  # the requests here fail with it


async def test_only_the_spreading_front_end_spreads_counting_the_others_queues(pool: Fixture) -> None:
    w0, w1 = await join(pool, "w0"), await join(pool, "w1")
    w0.send(p.PoolState(1000.0, 300.0, [p.HeldModel("a", 1, "ready", 300.0)]))
    w1.send(p.PoolState(1000.0, 0.0))
    await settle(pool, lambda: all(link.state is not None for link in pool.manager.links.values()))
    hot = config("a").model_copy(update={"max_batch_size": 4})
    pool.served.append(ServedModel(hot, waiting=40, serving=1, batch_cycle_s=0.1))
    pool.manager.spreads = lambda: False  # another front end holds the decider lease
    for _ in range(4):
        pool.manager.tick()
        pool.clock.advance(0.2)
    assert pool.manager.placement.pending("a", 1) is None
    pool.manager.spreads = lambda: True  # this one holds it now: 4 queued here, 36 on the others
    pool.served[0] = ServedModel(hot, waiting=4, serving=1, batch_cycle_s=0.1, elsewhere=36)
    pool.manager.tick()
    pool.clock.advance(1.1)  # heat that rests on the others' reports outlasts one
    pool.manager.tick()
    msg = await w1.receive()
    assert isinstance(msg, p.LoadModel) and msg.model == "a"
