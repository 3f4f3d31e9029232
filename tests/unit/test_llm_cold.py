"""The LLM kind's cold hold (kinds/llm/cold.py): an LLM model with no worker in service and a waker holds a
request's sequences while a worker starts, under the batch kind's cold rule (runtime/cold.py): the bound
and the eta against the deadline refuse with a 429 and Retry-After at once, the waker's reason with a
503, and no waker is the 503 as before. A held request is placed once a worker is in service; its
deadline, its caller leaving or the model stopping ends the wait. Held sequences are the demand the
scaling loop scales up from zero on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from inferd.clock import FakeClock
from inferd.cluster.load import LoadReports
from inferd.cluster.memory import MemoryStore
from inferd.config.autoscaler import AutoscalerConfig
from inferd.errors import DeadlineExceeded, Overloaded, ServingError, ShuttingDown, WorkerUnavailable
from inferd.fleet.scaling import ReportedDemand, scaling_loops
from inferd.kinds.builtin import builtin_kinds
from inferd.kinds.llm.demand import LLMDemand, LLMObservation, LLMObserver
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.service import Choices, GenerationRequest
from inferd.kinds.llm.sim_llm import sim_llm_config
from inferd.observability.metrics import Metrics
from inferd.runtime.cold import REWAKE_S
from inferd.runtime.frontend_load import ModelLoad
from inferd.runtime.registry import ModelRegistry
from inferd.runtime.waking import SCALE_FROM_ZERO, Wakers
from inferd.wire.connection import WorkerConnection
from tests.unit.test_cold_admission import FakeWaker
from tests.unit.test_llm_failover import RecordingWriter, adds
from tests.unit.test_scale_from_zero import COLD, Fleet, until


def cold_llm(
    waker: FakeWaker | None, wakers: Wakers | None = None, **config: Any
) -> tuple[LLMRuntime, FakeClock, Metrics]:
    clock, metrics, wakers = FakeClock(), Metrics(), wakers or Wakers()
    if waker is not None:
        wakers.set("sim-llm", waker, SCALE_FROM_ZERO)
    rt = LLMRuntime(
        sim_llm_config(workers=0, **config),
        clock,
        metrics.for_llm("sim-llm"),
        kill_worker=lambda w: None,
        wakers=wakers,
    )
    return rt, clock, metrics


def worker(i: int = 0) -> WorkerConnection:
    return WorkerConnection(f"sim-llm-{i}.0", "sim-llm", 100 + i, "local", RecordingWriter())  # type: ignore[arg-type]


def ask(rt: LLMRuntime, deadline: float | None = None, n: int = 1) -> asyncio.Task[Choices]:
    request = GenerationRequest(prompt="say it", n=n, max_tokens=4)
    return asyncio.create_task(rt.service.generate(request, deadline=deadline))


async def refused(rt: LLMRuntime, deadline: float | None = None, n: int = 1) -> ServingError:
    with pytest.raises(ServingError) as info:
        await ask(rt, deadline, n)
    return info.value


def cold_starts(metrics: Metrics) -> float | None:
    labels = {"model": "sim-llm", "cause": SCALE_FROM_ZERO}
    return metrics.registry.get_sample_value("inferd_cold_start_seconds_count", labels)


async def held(rt: LLMRuntime, count: int) -> None:
    await until(lambda: rt.cold.held == count)


# ---- refused at once -------------------------------------------------------------------------------------
async def test_without_a_waker_no_worker_is_the_503_as_before() -> None:
    rt, _, _ = cold_llm(None)
    assert not rt.ready
    exc = await refused(rt)
    assert isinstance(exc, WorkerUnavailable) and "has no ready worker" in exc.message
    assert rt.cold.held == 0


async def test_a_waker_that_cannot_wake_the_model_gives_its_reason_as_a_503() -> None:
    rt, _, _ = cold_llm(FakeWaker(reason="only its default version scales from zero"))
    assert not rt.ready
    exc = await refused(rt)
    assert isinstance(exc, WorkerUnavailable) and "only its default version" in exc.message


async def test_past_the_cold_bound_a_429_with_the_measured_eta_as_retry_after() -> None:
    waker = FakeWaker(eta=2.4)
    rt, _, _ = cold_llm(waker, params={"scheduler": {"max_waiting_seqs": 3}})
    assert rt.ready  # served on demand
    first = ask(rt, n=2)
    await held(rt, 2)
    exc = await refused(rt, n=2)  # 2 held + 2 > 3
    assert isinstance(exc, Overloaded) and exc.reason == "queue_full" and exc.retry_after_s == 2.4
    assert "cold queue is full (2/3" in exc.message
    second = ask(rt)  # 2 + 1 fits
    await held(rt, 3)
    first.cancel()
    second.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
    assert rt.cold.held == 0


def test_the_default_bound_is_four_sets_of_seats_within_the_waiting_room() -> None:
    rt, _, _ = cold_llm(FakeWaker(), params={"scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 64}})
    assert rt.cold.bound == 8
    rt, _, _ = cold_llm(FakeWaker(), params={"scheduler": {"max_waiting_seqs": 5}})
    assert rt.cold.bound == 5


async def test_a_deadline_nearer_than_the_measured_start_is_a_429_at_once() -> None:
    waker = FakeWaker(eta=2.0)
    rt, clock, _ = cold_llm(waker)
    exc = await refused(rt, deadline=clock.now() + 1.0)
    assert isinstance(exc, Overloaded) and exc.reason == "deadline" and exc.retry_after_s == 2.0
    assert "2000 ms to start" in exc.message
    assert waker.wakes == [] and rt.cold.held == 0  # nothing woke


# ---- held, then served ------------------------------------------------------------------------------------
async def test_a_held_request_is_placed_once_a_worker_is_in_service_and_the_cold_start_is_observed() -> None:
    waker = FakeWaker()
    rt, clock, metrics = cold_llm(waker)
    task = ask(rt, n=2)
    await held(rt, 2)
    assert not task.done()
    assert waker.wakes and waker.wakes[0][:3] == ("sim-llm", 1, 2)  # told at once, with what waits
    stats = rt.statistics()
    assert stats.detail.held == 2 and stats.detail.cold_for_s == 0.0
    assert LLMObserver().observe(stats, 0, None).waiting_seqs == 2  # the demand the loop scales on
    clock.advance(1.5)
    w = worker()
    rt.add_worker(w)
    choices = await task
    assert len(choices) == 2 and len(adds(w)) == 2
    assert rt.cold.held == 0 and rt.statistics().detail.cold_for_s is None
    assert cold_starts(metrics) == 1.0
    labels = {"model": "sim-llm", "cause": SCALE_FROM_ZERO}
    assert metrics.registry.get_sample_value("inferd_cold_start_seconds_sum", labels) == pytest.approx(1.5)


async def test_a_request_whose_worker_is_lost_before_it_is_placed_waits_for_the_next() -> None:
    waker = FakeWaker()
    rt, _, _ = cold_llm(waker)
    task = ask(rt)
    await held(rt, 1)
    lost = worker(0)
    rt.add_worker(lost)  # the held request is released ...
    rt.on_worker_lost(lost, "crashed")  # ... and the worker is gone before it runs
    await until(lambda: len(waker.wakes) == 2)  # held again, under the same rule, and the waker told again
    assert rt.cold.held == 1 and not task.done()
    w = worker(1)
    rt.add_worker(w)
    assert len(await task) == 1 and len(adds(w)) == 1 and adds(lost) == []


async def test_with_a_worker_in_service_nothing_is_held() -> None:
    waker = FakeWaker()
    rt, _, metrics = cold_llm(waker)
    w = worker()
    rt.add_worker(w)
    await ask(rt)
    assert waker.wakes == [] and len(adds(w)) == 1 and cold_starts(metrics) is None


async def test_the_waker_is_told_again_while_sequences_are_held() -> None:
    waker = FakeWaker()
    rt, clock, _ = cold_llm(waker)
    task = ask(rt)
    await held(rt, 1)
    rt.cold.rewake()
    assert len(waker.wakes) == 1  # told at admission; not again before REWAKE_S
    clock.advance(REWAKE_S)
    rt.cold.rewake()
    assert len(waker.wakes) == 2 and waker.wakes[1][3] == pytest.approx(REWAKE_S)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    clock.advance(REWAKE_S)
    rt.cold.rewake()
    assert len(waker.wakes) == 2 and rt.cold.since is None  # nothing held: no wake, and no cold start


async def test_a_failing_waker_leaves_the_request_held() -> None:
    class Failing(FakeWaker):
        def wake(self, model: str, version: int, waiting: int, oldest_age_s: float) -> None:
            raise RuntimeError("down")

    rt, _, _ = cold_llm(Failing())
    task = ask(rt)
    await held(rt, 1)
    rt.add_worker(worker())
    assert len(await task) == 1


# ---- the wait ends without a worker -------------------------------------------------------------------------
async def test_a_held_request_past_its_deadline_is_a_504_and_no_longer_held() -> None:
    rt, clock, _ = cold_llm(FakeWaker())
    task = ask(rt, deadline=clock.now() + 0.05)  # the hold waits 50 ms of the loop's time
    with pytest.raises(DeadlineExceeded, match="waiting for a worker to start"):
        await task
    assert rt.cold.held == 0
    w = worker()
    rt.add_worker(w)
    assert adds(w) == []  # nothing of it reaches the worker that came late


async def test_without_a_deadline_the_hold_ends_after_the_default_timeout_with_a_503() -> None:
    rt, _, _ = cold_llm(FakeWaker(), default_timeout_ms=50.0)
    with pytest.raises(WorkerUnavailable, match="no worker in service within 50 ms"):
        await ask(rt)
    assert rt.cold.held == 0


async def test_a_caller_that_leaves_is_no_longer_held_and_nothing_is_placed() -> None:
    rt, _, _ = cold_llm(FakeWaker())
    task = ask(rt, n=3)
    await held(rt, 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rt.cold.held == 0
    w = worker()
    rt.add_worker(w)
    await asyncio.sleep(0)
    assert adds(w) == [] and rt.placement.live == {}


async def test_stopping_the_model_fails_the_held_requests_and_refuses_new_ones() -> None:
    rt, _, _ = cold_llm(FakeWaker())
    task = ask(rt)
    await held(rt, 1)
    rt.stop(ShuttingDown("the server is shutting down"))
    with pytest.raises(ShuttingDown):
        await task
    assert not rt.ready
    exc = await refused(rt)
    assert isinstance(exc, WorkerUnavailable) and "shutting down" in exc.message


# ---- the scaling loop wakes it ------------------------------------------------------------------------------
def llm_registry(wakers: Wakers, autoscale: AutoscalerConfig = COLD) -> tuple[ModelRegistry, LLMRuntime, Metrics]:
    rt, _, metrics = cold_llm(None, wakers, autoscale=autoscale)
    registry = ModelRegistry()
    registry.add(rt)
    return registry, rt, metrics


def loops_of(registry: ModelRegistry, fleet: Fleet, wakers: Wakers, decides: bool = True) -> dict[str, Any]:
    clock = registry.get("sim-llm").clock  # type: ignore[attr-defined]
    return scaling_loops(registry, fleet, clock, builtin_kinds(), None, None, wakers, decides)  # type: ignore[arg-type]


async def test_held_llm_requests_wake_the_scaling_loop_which_scales_from_zero() -> None:
    wakers = Wakers()
    registry, rt, metrics = llm_registry(wakers)
    fleet = Fleet()
    loop = loops_of(registry, fleet, wakers)["sim-llm"]
    wake = wakers.of("sim-llm")
    assert wake is not None and wake.waker is loop and wake.cause == SCALE_FROM_ZERO
    loop.interval_s = 3600.0  # only a wake makes it look
    assert rt.ready
    running = asyncio.create_task(loop.run())
    try:
        task = ask(rt)
        await until(lambda: fleet.targets == [1])
        assert loop.last is not None and "from zero" in loop.last.reason and "1 waiting" in loop.last.reason
        rt.clock.advance(3.0)  # type: ignore[attr-defined]
        w = worker()
        rt.add_worker(w)
        assert len(await task) == 1 and len(adds(w)) == 1
        await until(lambda: loop.eta_s("sim-llm", 1) is not None)
        assert loop.eta_s("sim-llm", 1) == pytest.approx(3.0) and cold_starts(metrics) == 1.0
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


def test_an_idle_llm_model_is_not_kept_up_by_its_recent_time_to_first_token() -> None:
    demand = LLMDemand(COLD)

    def clamp(n: int) -> int:
        return max(COLD.min_workers, min(COLD.max_workers, n))

    def obs(running: int, ttft_s: float | None) -> LLMObservation:
        return LLMObservation(1, 0, running, 0, 0.0, ttft_s)

    assert demand.recommend(obs(0, 1.5), 1, clamp).workers == 0  # idle: scales to zero
    assert demand.recommend(obs(1, 1.5), 1, clamp).workers == 1  # busy: the TTFT counts
    assert demand.recommend(obs(1, 3.0 * COLD.target_ttft_s), 1, clamp).workers == 3


async def test_a_follower_holds_and_reports_its_held_sequences_which_the_owners_loop_counts() -> None:
    wakers = Wakers()
    registry, rt, _ = llm_registry(wakers)
    assert loops_of(registry, Fleet(), wakers, decides=False) == {}
    wake = wakers.of("sim-llm")
    assert wake is not None and isinstance(wake.waker, ReportedDemand) and rt.ready
    task = ask(rt, n=2)
    await held(rt, 2)
    clock = rt.clock
    store = MemoryStore(clock)
    follower = LoadReports(store, "1", registry, builtin_kinds(), clock, index=1)
    assert follower.measure().loads == [ModelLoad("sim-llm", 1, 2)]
    assert await follower.report()
    owners, owner_rt, _ = llm_registry(Wakers())
    owner = LoadReports(store, "0", owners, builtin_kinds(), clock, index=0, reads=True)
    await owner.collect()
    assert owner.loads is not None
    observed = LLMObserver().observe(owner_rt.statistics(), 0, owner.loads)
    assert observed.waiting_seqs == 2  # the follower's held sequences: the owner scales from zero on them
    owner_rt.add_worker(worker())
    observed = LLMObserver().observe(owner_rt.statistics(), 0, owner.loads)
    assert observed.waiting_seqs == 0  # with a worker, the engines' own counts say what waits
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert follower.measure().loads == [ModelLoad("sim-llm", 1, 0)]
