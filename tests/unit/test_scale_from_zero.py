"""Scale from zero: the Autoscaler's first scale-up from zero waits for no window nor cooldown; the
scaling loop is the waker (runtime/waking.py) of a `min_workers = 0` model: held requests count as
demand, a wake makes it look at once, and the time from its scale-up to a ready worker is its eta."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from inferd.clock import FakeClock
from inferd.config.autoscaler import AutoscalerConfig
from inferd.fleet.autoscaler import Action, Autoscaler
from inferd.fleet.scaling import ReportedDemand, ScalingLoop, ScalingLoops, scaling_loops
from inferd.kinds.batch.demand import BatchDemand, Observation
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.kinds.builtin import builtin_kinds
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.runtime.registry import ModelRegistry
from inferd.runtime.waking import SCALE_FROM_ZERO, Wakers
from tests.fakes.worker import fake_connection

COLD = AutoscalerConfig(
    min_workers=0,
    max_workers=4,
    scale_up_cooldown_s=30.0,
    scale_down_cooldown_s=30.0,
    scale_up_stabilization_s=20.0,
    scale_down_stabilization_s=5.0,
)


def observed(ready: int, queued: int = 0, rate: float = 0.0, starting: int = 0) -> Observation:
    return Observation(
        ready_workers=ready,
        starting_workers=starting,
        queue_depth_items=queued,
        arrival_rate_items_s=rate,
        max_batch_size=8,
        busy_ratio=0.0,
        batch_latency_s=0.05,
        items_per_batch=1.0,
    )


def test_the_first_scale_up_from_zero_waits_for_no_cooldown_nor_window() -> None:
    clock = FakeClock()
    scaler = Autoscaler(COLD, clock, BatchDemand(COLD))
    assert scaler.decide(observed(1)).target_workers == 1  # idle, but the down-window is not yet seen
    clock.advance(6.0)
    down = scaler.decide(observed(1))
    assert down.action is Action.DOWN and down.target_workers == 0
    clock.advance(1.0)  # well inside both cooldowns and the 20 s up-window
    up = scaler.decide(observed(0, queued=3))
    assert (up.action, up.target_workers) == (Action.UP, 1) and "from zero" in up.reason
    clock.advance(1.0)  # from one, the window and the cooldown damp again
    held = scaler.decide(observed(0, queued=200, rate=500.0, starting=1))
    assert held.action is Action.HOLD and "up window" in held.reason
    clock.advance(21.0)  # the up-window seen, the cooldown (30 s) not yet
    held = scaler.decide(observed(0, queued=200, rate=500.0, starting=1))
    assert held.action is Action.HOLD and "cooldown" in held.reason


def test_a_scale_up_from_zero_still_takes_bounded_steps() -> None:
    config = COLD.model_copy(update={"max_step_up_workers": 2})
    scaler = Autoscaler(config, FakeClock(), BatchDemand(config))
    up = scaler.decide(observed(0, queued=400, rate=2000.0))
    assert (up.current_workers, up.target_workers) == (0, 2)


def test_no_demand_at_zero_stays_at_zero() -> None:
    scaler = Autoscaler(COLD, FakeClock(), BatchDemand(COLD))
    assert scaler.decide(observed(0)).target_workers == 0


class Fleet:
    """Fleet control as the scaling loop uses it: its scale-ups are recorded; the test starts workers."""

    def __init__(self) -> None:
        self.targets: list[int] = []
        self.slots = 0

    def local_workers(self, model: str, version: int | None = None) -> int:
        return self.slots

    async def scale_to(self, model: str, workers: int, version: int | None = None) -> int:
        self.targets.append(workers)
        self.slots = workers
        return workers


def served(wakers: Wakers, autoscale: AutoscalerConfig | None = COLD) -> tuple[ModelRegistry, ModelRuntime, Metrics]:
    clock, metrics = FakeClock(), Metrics()
    config = sim_config(max_batch_size=8, max_wait_ms=0.0, workers=0, autoscale=autoscale)
    rt = ModelRuntime(config, clock, metrics.for_model("sim"), RetryBudget(clock), lambda w: None, wakers=wakers)
    registry = ModelRegistry()
    registry.add(rt)
    return registry, rt, metrics


def loops(registry: ModelRegistry, fleet: Fleet, wakers: Wakers, decides: bool = True) -> dict[str, ScalingLoop]:
    clock = registry.get("sim").clock  # type: ignore[attr-defined]
    return scaling_loops(registry, fleet, clock, builtin_kinds(), None, None, wakers, decides)  # type: ignore[arg-type]


def test_the_scaling_loop_of_a_min_workers_0_model_is_its_waker() -> None:
    wakers = Wakers()
    registry, _, _ = served(wakers)
    built = loops(registry, Fleet(), wakers)
    wake = wakers.of("sim")
    assert wake is not None and wake.waker is built["sim"] and wake.cause == SCALE_FROM_ZERO
    assert built["sim"].wakeable("sim", 1) is None
    assert "only its default version 1" in (built["sim"].wakeable("sim", 2) or "")


def test_a_model_that_keeps_a_worker_has_no_waker() -> None:
    wakers = Wakers()
    registry, rt, _ = served(wakers, AutoscalerConfig(min_workers=1))
    assert set(loops(registry, Fleet(), wakers)) == {"sim"}
    assert wakers.of("sim") is None and not rt.ready


async def test_a_front_end_that_runs_no_autoscaler_holds_for_the_owners_loop() -> None:
    wakers = Wakers()
    registry, rt, _ = served(wakers)
    assert loops(registry, Fleet(), wakers, decides=False) == {}
    wake = wakers.of("sim")
    assert wake is not None and isinstance(wake.waker, ReportedDemand)
    assert rt.ready
    rt.enqueue([b"a"], None)  # held: the owner sees it in this front end's reported load
    assert len(rt.queue) == 1


async def test_held_requests_wake_the_loop_which_scales_from_zero_and_times_the_start() -> None:
    wakers = Wakers()
    registry, rt, metrics = served(wakers)
    fleet = Fleet()
    loop = loops(registry, fleet, wakers)["sim"]
    loop.interval_s = 3600.0  # only a wake makes it look
    clock = rt.clock
    assert rt.ready and loop.eta_s("sim", 1) is None
    task = asyncio.create_task(loop.run())
    try:
        items = rt.enqueue([b"a", b"b"], None)
        await until(lambda: fleet.targets == [1])
        assert loop.last is not None and "from zero" in loop.last.reason
        assert loop.observed is not None and loop.observed.signals()["queued_items"] == 2  # held = demand
        rt.enqueue([b"c"], None)  # a worker is planned: no other look, no other scale-up
        await asyncio.sleep(0.01)
        assert fleet.targets == [1] and loop.autoscaler.statistics().decisions == 1
        clock.advance(2.5)  # type: ignore[attr-defined]
        worker = fake_connection("sim-0.1", 100)
        rt.add_worker(worker)
        await until(lambda: loop.eta_s("sim", 1) is not None)
        assert loop.eta_s("sim", 1) == pytest.approx(2.5)
        count = metrics.registry.get_sample_value(
            "inferd_cold_start_seconds_count", {"model": "sim", "cause": SCALE_FROM_ZERO}
        )
        assert count == 1.0
        rt.dispatch_due()
        (batch,) = worker.inflight.values()
        assert [i.reply for i in batch.items][:2] == [i.reply for i in items]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def until(check: Callable[[], bool], timeout_s: float = 2.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 - the loop task and the runtime set it
            await asyncio.sleep(0.005)


async def test_a_model_served_anew_gets_a_fresh_loop_and_waker() -> None:
    """ScalingLoops.renew (a model loaded while serving): the model's loop is rebuilt from the config served
    now, with an autoscaler that remembers no target (the old one's is stale: its workers were stopped by
    the unload), the old loop's task stops, and the waker follows the new config."""
    wakers = Wakers()
    registry, rt, _ = served(wakers)
    fleet = Fleet()
    running = ScalingLoops(lambda only: scaling_loops(registry, fleet, rt.clock, builtin_kinds(), None, None, wakers, True, only), wakers)  # type: ignore[arg-type]
    task = asyncio.create_task(running.run())
    await asyncio.sleep(0)
    old = running.loops["sim"]
    old.autoscaler.decide(observed(0, queued=3))  # scaled up from zero: its target is 1
    assert old.autoscaler.target_workers == 1
    (old_task,) = [t for t in asyncio.all_tasks() if t.get_name() == "autoscale-sim"]
    registry.remove("sim", 1)  # unloaded, then loaded again
    registry.add(served(wakers)[1])
    running.renew("sim")
    await asyncio.sleep(0)
    new = running.loops["sim"]
    assert new is not old and new.autoscaler.target_workers is None and old_task.cancelled()
    wake = wakers.of("sim")
    assert wake is not None and wake.waker is new
    registry.remove("sim", 1)  # loaded again, its [autoscale] table gone from its folder
    registry.add(served(wakers, None)[1])
    running.renew("sim")
    assert "sim" not in running.loops and wakers.of("sim") is None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_fleet_taken_to_zero_under_the_loop_is_woken_again() -> None:
    """The loop scaled a `min_workers = 0` model up from zero (its target: 1), then the fleet went to zero
    beneath it (an operator's `inferd fleet scale sim 0`, POST /admin/models/sim/scale): requests held
    then are demand at zero workers, and the loop scales up from zero again. It once trusted its own target
    (1): it never woke, and the held requests waited to their deadline."""
    wakers = Wakers()
    registry, rt, _ = served(wakers)
    fleet = Fleet()
    loop = loops(registry, fleet, wakers)["sim"]
    loop.interval_s = 3600.0  # only a wake makes it look
    task = asyncio.create_task(loop.run())
    try:
        rt.enqueue([b"a"], None)
        await until(lambda: fleet.targets == [1])
        rt.add_worker(worker := fake_connection("sim-0.1", 100))
        assert rt.ready_workers == 1
        rt.on_worker_lost(worker, "drained")  # the operator's scale to 0: its worker gone, no slot left
        fleet.slots = 0
        rt.enqueue([b"b"], None)
        await until(lambda: fleet.targets == [1, 1])
        assert loop.last is not None and "from zero" in loop.last.reason
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
