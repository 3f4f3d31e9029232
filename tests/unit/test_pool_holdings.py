"""worker/holdings.py in process, with model servers that only wait to be drained: the models of one
pool worker run one batch at a time between them (the shared compute lock), a load runs beside the
batches of the models loaded (never under that lock), and loads, evictions and unloads are told to every
front end as the residency decides them."""

from __future__ import annotations

import asyncio

from inferd.models.sim import sim_config
from inferd.pools.residency import Limits
from inferd.wire import protocol as p
from inferd.worker.credits import Seat
from inferd.worker.device import Device
from inferd.worker.holdings import Holdings
from tests import pool_models


class WaitingServer:
    """A model server that serves nobody: it runs until drained."""

    def __init__(self, model: str, version: int, device: Device, seat: Seat, tell: object) -> None:
        self.device = device
        self.seat = seat
        self.links: dict[int, object] = {}
        self.draining = False
        self.drained = asyncio.Event()

    async def run(self) -> int:
        await self.drained.wait()
        return 0

    def drain(self, signalled: bool = False) -> bool:
        self.drained.set()
        return True


def config_json(name: str, implementation: str = "inferd.models.sim:SimModel", **params: object) -> bytes:
    config = sim_config(name, base_ms=0.0, per_item_ms=0.0, params=params)
    return config.model_copy(update={"implementation": implementation}).model_dump_json().encode()


class Told:
    def __init__(self) -> None:
        self.messages: list[p.Message] = []
        self.arrived = asyncio.Event()

    def __call__(self, msg: p.Message) -> None:
        self.messages.append(msg)
        self.arrived.set()

    async def result(self, model: str) -> p.LoadResult:
        async with asyncio.timeout(20):
            while True:
                for msg in self.messages:
                    if isinstance(msg, p.LoadResult) and msg.model == model:
                        self.messages.remove(msg)
                        return msg
                self.arrived.clear()
                await self.arrived.wait()


async def test_models_take_turns_on_the_device_and_a_load_runs_beside_their_batches() -> None:
    told = Told()
    holdings = Holdings("pw", None, told, WaitingServer)
    holdings.configure(Limits(budget_mb=1000.0, max_concurrent_loads=1, min_resident_s=0.0))
    counting = "tests.pool_models:CountingBatches"
    pool_models.LOAD_GATE.clear()
    pool_models.LOAD_STARTED.clear()
    async with asyncio.TaskGroup() as tg:
        planner = tg.create_task(holdings.plan(tg))
        for name in ("a", "b"):
            assert holdings.ask(p.LoadModel(name, 1, config_json(name, counting))) is None
            assert (await told.result(name)).ok
        gated = p.LoadModel("slow", 1, config_json("slow", "tests.pool_models:GatedLoad"))
        assert holdings.ask(gated) is None
        await asyncio.to_thread(pool_models.LOAD_STARTED.wait, 20)
        pool_models.Overlap.most = 0
        devices = [holdings.servers[("a", 1)].device, holdings.servers[("b", 1)].device]
        batches = [device.run_one(p.RunBatch(i, [b"x"])) for i in range(4) for device in devices]
        done = await asyncio.gather(*batches)  # while "slow" is still loading
        assert all(d.batch_error is None for d in done)
        assert pool_models.Overlap.most == 1  # two models, eight batches: never two at once
        assert ("slow", 1) not in holdings.servers and holdings.residency.held[("slow", 1)].state == "loading"
        pool_models.LOAD_GATE.set()
        assert (await told.result("slow")).ok
        holdings.close()
        async with asyncio.timeout(20):
            await holdings.emptied()
        planner.cancel()
    told_states = [m for m in told.messages if isinstance(m, p.PoolState)]
    assert any({m.model for m in s.models} == {"a", "b", "slow"} for s in told_states)  # slow loading beside
    final = holdings.state()
    assert final.models == [] and final.used_mb == 0.0 and final.loads == {"a": 1, "b": 1, "slow": 1}


async def test_an_eviction_drains_the_model_server_and_every_front_end_is_told() -> None:
    told = Told()
    holdings = Holdings("pw", None, told, WaitingServer)
    holdings.configure(Limits(budget_mb=1000.0, max_loaded_models=1, min_resident_s=0.0))
    async with asyncio.TaskGroup() as tg:
        planner = tg.create_task(holdings.plan(tg))
        holdings.ask(p.LoadModel("a", 1, config_json("a", load_ms=50)))
        first = await told.result("a")
        assert first.ok and first.load_s >= 0.05
        again = holdings.ask(p.LoadModel("a", 1, config_json("a")))
        assert again is not None and again.ok  # held already: answered at once, with what its load took
        assert (again.load_s, again.memory_mb) == (first.load_s, first.memory_mb)
        a = holdings.servers[("a", 1)]
        holdings.ask(p.LoadModel("b", 1, config_json("b")))
        assert (await told.result("b")).ok
        assert a.drained.is_set()  # type: ignore[attr-defined]
        assert set(holdings.residency.held) == {("b", 1)}
        assert holdings.state().evictions == {"a": 1}
        holdings.close()
        async with asyncio.timeout(20):
            await holdings.emptied()
        planner.cancel()


async def test_loads_past_max_concurrent_loads_wait_their_turn_and_are_counted_as_waiting() -> None:
    told = Told()
    holdings = Holdings("pw", None, told, WaitingServer)
    holdings.configure(Limits(budget_mb=1000.0, max_concurrent_loads=1))
    pool_models.LOAD_GATE.clear()
    pool_models.LOAD_STARTED.clear()
    gated = "tests.pool_models:GatedLoad"
    async with asyncio.TaskGroup() as tg:
        planner = tg.create_task(holdings.plan(tg))
        for name in ("one", "two"):
            assert holdings.ask(p.LoadModel(name, 1, config_json(name, gated))) is None
        await asyncio.to_thread(pool_models.LOAD_STARTED.wait, 20)
        state = holdings.state()
        assert {m.model: m.state for m in state.models} == {"one": "loading"} and state.waiting_loads == 1
        joined = holdings.ask(p.LoadModel("two", 1, config_json("two", gated)))
        assert joined is None and holdings.state().waiting_loads == 1  # the same load, asked again
        pool_models.LOAD_GATE.set()
        assert (await told.result("one")).ok and (await told.result("two")).ok
        assert [r for r in told.messages if isinstance(r, p.LoadResult)] == []  # one LoadResult per load
        holdings.close()
        async with asyncio.timeout(20):
            await holdings.emptied()
        planner.cancel()


async def test_loads_that_ran_together_are_not_measured_at_both_their_sizes() -> None:
    """Resident memory measured around a load counts whatever else took or gave memory meanwhile: two
    loads side by side (max_concurrent_loads = 2) each measured the other's too (80 MB for a 40 MB
    model), and that size then replaced the estimate, halving what the worker holds. A load measured
    beside another keeps the size it was planned at (its estimate, or its last clean measure)."""
    told = Told()
    holdings = Holdings("pw", None, told, WaitingServer)
    holdings.configure(Limits(budget_mb=1000.0, max_concurrent_loads=2))
    pool_models.LOAD_GATE.clear()
    gated = "tests.pool_models:GatedLoad"
    while pool_models.LOADS_STARTED.acquire(blocking=False):  # what earlier tests left
        pass
    async with asyncio.TaskGroup() as tg:
        planner = tg.create_task(holdings.plan(tg))
        for name in ("one", "two"):
            config = sim_config(name, base_ms=0.0, per_item_ms=0.0, memory_mb=40.0, params={"memory_mb": 40})
            config = config.model_copy(update={"implementation": gated})
            assert holdings.ask(p.LoadModel(name, 1, config.model_dump_json().encode())) is None
        for _ in range(2):  # both have taken their memory before either ends
            assert await asyncio.to_thread(pool_models.LOADS_STARTED.acquire, True, 20)
        pool_models.LOAD_GATE.set()
        sizes = [(await told.result(name)).memory_mb for name in ("one", "two")]
        assert sizes == [40.0, 40.0], sizes
        assert holdings.state().used_mb == 80.0
        holdings.close()
        async with asyncio.timeout(20):
            await holdings.emptied()
        planner.cancel()


async def test_draining_during_a_load_gives_up_the_queued_ones_and_unloads_the_loading_one_once_loaded() -> None:
    told = Told()
    holdings = Holdings("pw", None, told, WaitingServer)
    holdings.configure(Limits(budget_mb=1000.0, max_concurrent_loads=1))
    pool_models.LOAD_GATE.clear()
    pool_models.LOAD_STARTED.clear()
    gated = "tests.pool_models:GatedLoad"
    async with asyncio.TaskGroup() as tg:
        planner = tg.create_task(holdings.plan(tg))
        holdings.ask(p.LoadModel("one", 1, config_json("one", gated)))
        holdings.ask(p.LoadModel("two", 1, config_json("two", gated)))
        await asyncio.to_thread(pool_models.LOAD_STARTED.wait, 20)
        holdings.close()
        queued = await told.result("two")
        assert not queued.ok and "before its load started" in queued.error
        refused = holdings.ask(p.LoadModel("three", 1, config_json("three")))
        assert refused is not None and not refused.ok and "drains" in refused.error
        pool_models.LOAD_GATE.set()
        assert (await told.result("one")).ok
        async with asyncio.timeout(20):
            await holdings.emptied()  # "one" loaded, then at once drained and unloaded
        assert holdings.servers == {} and holdings.state().models == []
        planner.cancel()


async def test_what_a_front_end_can_make_it_hold_is_bounded_and_let_go_after_each_unload() -> None:
    """Loads past max_waiting_loads are refused at once, naming the bound; a model's config (and what its
    load took) goes once it is unloaded, or its load failed."""
    told = Told()
    holdings = Holdings("pw", None, told, WaitingServer)
    holdings.configure(Limits(budget_mb=1000.0, max_concurrent_loads=1, max_waiting_loads=1))
    pool_models.LOAD_GATE.clear()
    pool_models.LOAD_STARTED.clear()
    gated = "tests.pool_models:GatedLoad"
    async with asyncio.TaskGroup() as tg:
        planner = tg.create_task(holdings.plan(tg))
        assert holdings.ask(p.LoadModel("one", 1, config_json("one", gated))) is None
        await asyncio.to_thread(pool_models.LOAD_STARTED.wait, 20)
        assert holdings.ask(p.LoadModel("two", 1, config_json("two"))) is None  # waits behind "one"
        refused = holdings.ask(p.LoadModel("three", 1, config_json("three")))
        assert refused is not None and not refused.ok and "at most 1" in refused.error, refused
        assert set(holdings.configs) == {("one", 1), ("two", 1)}
        pool_models.LOAD_GATE.set()
        assert (await told.result("one")).ok and (await told.result("two")).ok
        broken = config_json("broken", "tests.no_such_module:Nothing")
        assert holdings.ask(p.LoadModel("broken", 1, broken)) is None
        assert not (await told.result("broken")).ok
        for name in ("one", "two"):
            holdings.unload((name, 1))
        async with asyncio.timeout(20):
            await holdings.emptied()
        assert holdings.configs == {} and holdings.load_s == {}
        planner.cancel()


async def test_a_model_with_a_batch_staged_on_the_worker_is_busy_and_not_evicted() -> None:
    """a is the least recently used, but holds a batch (received, waiting behind the device's running
    one, not yet at the compute lock): b is evicted for c instead."""
    told = Told()
    holdings = Holdings("pw", None, told, WaitingServer)
    holdings.configure(Limits(budget_mb=1000.0, max_loaded_models=2, min_resident_s=0.0))
    async with asyncio.TaskGroup() as tg:
        planner = tg.create_task(holdings.plan(tg))
        for name in ("a", "b"):
            holdings.ask(p.LoadModel(name, 1, config_json(name)))
            assert (await told.result(name)).ok
        a, b = holdings.servers[("a", 1)], holdings.servers[("b", 1)]
        a.seat.join(0)  # type: ignore[attr-defined]
        a.seat.received(0, items=1)  # type: ignore[attr-defined]
        assert not holdings.state().models[0].evictable
        holdings.ask(p.LoadModel("c", 1, config_json("c")))
        assert (await told.result("c")).ok
        assert b.drained.is_set() and not a.drained.is_set()  # type: ignore[attr-defined]
        assert set(holdings.residency.held) == {("a", 1), ("c", 1)}
        a.seat.finished()  # type: ignore[attr-defined]
        assert holdings.residency.held[("a", 1)].busy == 0
        holdings.close()
        async with asyncio.timeout(20):
            await holdings.emptied()
        assert holdings.ledger.held == 0
        planner.cancel()
