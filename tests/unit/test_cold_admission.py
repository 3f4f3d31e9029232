"""Cold admission (kinds/batch/cold.py): a batch model with no worker in service and a waker holds its
requests in a bounded cold queue instead of the 503, and tells its waker; without a waker, the 503 as
before. The rule on a FakeClock, then the runtime that applies it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from inferd.clock import FakeClock
from inferd.errors import Overloaded, ServingError, WorkerUnavailable
from inferd.kinds.batch import cold
from inferd.kinds.batch.cold import cold_bound, cold_refusal
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.runtime.waking import POOL_LOAD, SCALE_FROM_ZERO, Wakers
from tests.fakes.worker import fake_connection


@dataclass
class FakeWaker:
    """Records every wake; says what the test sets (a reason it cannot wake, a measured eta)."""

    reason: str | WorkerUnavailable | None = None
    eta: float | None = None
    wakes: list[tuple[str, int, int, float]] = field(default_factory=list)

    def wakeable(self, model: str, version: int) -> str | WorkerUnavailable | None:
        return self.reason

    def wake(self, model: str, version: int, waiting: int, oldest_age_s: float) -> None:
        self.wakes.append((model, version, waiting, oldest_age_s))

    def eta_s(self, model: str, version: int) -> float | None:
        return self.eta


def cold_runtime(
    waker: FakeWaker | None, cause: str = SCALE_FROM_ZERO, wakers: Wakers | None = None, **config: object
) -> tuple[ModelRuntime, FakeClock, Metrics]:
    clock, metrics, wakers = FakeClock(), Metrics(), wakers or Wakers()
    if waker is not None:
        wakers.set("sim", waker, cause)
    config.setdefault("max_batch_size", 4)
    rt = ModelRuntime(
        sim_config(max_wait_ms=0.0, version=2, **config),  # type: ignore[arg-type]
        clock,
        metrics.for_model("sim", 2),
        RetryBudget(clock),
        kill_worker=lambda w: None,
        wakers=wakers,
    )
    return rt, clock, metrics


def cold_starts(metrics: Metrics, cause: str) -> tuple[float | None, float | None]:
    labels = {"model": "sim", "cause": cause}
    r = metrics.registry
    return (
        r.get_sample_value("inferd_cold_start_seconds_count", labels),
        r.get_sample_value("inferd_cold_start_seconds_sum", labels),
    )


# ---- the rule -----------------------------------------------------------------------------------------


def test_the_cold_bound_defaults_to_four_batches_within_the_queue() -> None:
    assert cold_bound(None, max_queue_size=2000, max_batch_size=100) == 400
    assert cold_bound(None, max_queue_size=50, max_batch_size=100) == 50
    assert cold_bound(7, max_queue_size=2000, max_batch_size=100) == 7
    assert cold_bound(5000, max_queue_size=2000, max_batch_size=100) == 2000


def test_past_the_bound_a_429_with_the_eta_as_retry_after() -> None:
    assert cold_refusal("m", queued=7, n=1, bound=8, now=0.0, deadline=None, eta_s=None) is None
    full = cold_refusal("m", queued=7, n=2, bound=8, now=0.0, deadline=None, eta_s=2.4)
    assert isinstance(full, Overloaded) and full.reason == "queue_full"
    assert full.retry_after_s == 2.4 and "retry in 3 s" in str(full) and "cold queue is full (7/8" in str(full)
    unmeasured = cold_refusal("m", queued=8, n=1, bound=8, now=0.0, deadline=None, eta_s=None)
    assert isinstance(unmeasured, Overloaded) and unmeasured.retry_after_s == 1.0


def test_an_eta_past_the_deadline_is_a_429_at_once() -> None:
    late = cold_refusal("m", queued=0, n=1, bound=8, now=10.0, deadline=11.5, eta_s=2.0)
    assert isinstance(late, Overloaded) and late.reason == "deadline" and late.retry_after_s == 2.0
    assert "takes 2000 ms to start" in str(late) and "1500 ms" in str(late)
    assert cold_refusal("m", queued=0, n=1, bound=8, now=10.0, deadline=12.5, eta_s=2.0) is None
    # no eta measured yet: the request is held (its deadline still expires it in the queue)
    assert cold_refusal("m", queued=0, n=1, bound=8, now=10.0, deadline=10.1, eta_s=None) is None


# ---- the runtime --------------------------------------------------------------------------------------


async def test_without_a_waker_no_worker_is_the_503_as_before() -> None:
    rt, _, _ = cold_runtime(None)
    assert not rt.ready
    with pytest.raises(WorkerUnavailable, match="has no ready worker"):
        rt.precheck()
    with pytest.raises(WorkerUnavailable, match="has no ready worker"):
        rt.enqueue([b"a"], None)
    assert len(rt.queue) == 0


async def test_a_waker_that_cannot_wake_gives_its_reason_as_the_503() -> None:
    waker = FakeWaker(reason="pool 'p' has no worker")
    rt, _, _ = cold_runtime(waker, POOL_LOAD)
    assert not rt.ready
    with pytest.raises(WorkerUnavailable, match="pool 'p' has no worker"):
        rt.enqueue([b"a"], None)
    assert len(rt.queue) == 0 and waker.wakes == []


async def test_a_waker_may_give_the_503_itself_with_its_retry_after() -> None:
    waker = FakeWaker(reason=WorkerUnavailable("loading model 'sim' failed: out of memory; retry in 8 s", 7.5))
    rt, _, _ = cold_runtime(waker, POOL_LOAD)
    assert not rt.ready
    with pytest.raises(WorkerUnavailable, match="out of memory") as refused:
        rt.enqueue([b"a"], None)
    assert refused.value.retry_after_s == 7.5 and len(rt.queue) == 0


async def test_held_requests_wake_the_waker_and_are_served_by_the_first_worker() -> None:
    waker = FakeWaker()
    rt, clock, metrics = cold_runtime(waker)
    assert rt.ready  # served on demand
    first = rt.enqueue([b"a"], clock.now() + 30.0)
    assert waker.wakes == [("sim", 2, 1, 0.0)]
    clock.advance(0.5)
    second = rt.enqueue([b"b", b"c"], None)
    assert waker.wakes[-1] == ("sim", 2, 3, 0.5)
    assert rt.statistics().queued == 3 and rt.dispatch_due() is None  # nothing to send them to
    assert rt.statistics().detail.cold_for_s == 0.5
    clock.advance(1.5)
    worker = fake_connection("sim-0.1", 100)
    worker.version = 2
    rt.add_worker(worker)
    assert cold_starts(metrics, SCALE_FROM_ZERO) == (1.0, 2.0)  # from the first held to the worker
    assert rt.statistics().detail.cold_for_s is None
    rt.dispatch_due()
    (batch,) = worker.inflight.values()
    assert [i.payload for i in batch.items] == [b"a", b"b", b"c"]
    assert [i.reply for i in batch.items] == [first[0].reply, *(i.reply for i in second)]
    rt.enqueue([b"d"], None)  # a worker in service: admitted as any request, no wake
    assert len(waker.wakes) == 2 and cold_starts(metrics, SCALE_FROM_ZERO) == (1.0, 2.0)


async def test_past_the_cold_bound_a_429_with_retry_after_and_nothing_queued() -> None:
    waker = FakeWaker(eta=2.2)
    rt, _, _ = cold_runtime(waker, cold_queue_size=3)
    rt.enqueue([b"a", b"b"], None)
    with pytest.raises(Overloaded) as refused:
        rt.enqueue([b"c", b"d"], None)
    assert refused.value.reason == "queue_full" and refused.value.retry_after_s == 2.2
    assert len(rt.queue) == 2
    rt.enqueue([b"c"], None)
    with pytest.raises(Overloaded):  # the precheck, before the body is read, already says full
        rt.precheck()
    assert len(rt.queue) == 3


async def test_the_default_cold_bound_is_four_full_batches() -> None:
    rt, _, _ = cold_runtime(FakeWaker(), max_batch_size=2, max_queue_size=100)
    rt.enqueue([b"x"] * 8, None)
    with pytest.raises(Overloaded, match=r"cold queue is full \(8/8"):
        rt.enqueue([b"y"], None)


async def test_a_deadline_nearer_than_the_measured_start_is_refused_at_once() -> None:
    waker = FakeWaker(eta=3.0)
    rt, clock, _ = cold_runtime(waker)
    with pytest.raises(Overloaded) as refused:
        rt.enqueue([b"a"], clock.now() + 1.0)
    assert refused.value.reason == "deadline" and refused.value.retry_after_s == 3.0
    assert len(rt.queue) == 0 and waker.wakes == []
    rt.enqueue([b"a"], clock.now() + 5.0)
    assert len(rt.queue) == 1 and len(waker.wakes) == 1


async def test_a_failed_wake_answers_the_held_requests_and_restarts_the_measure() -> None:
    waker = FakeWaker()
    rt, clock, metrics = cold_runtime(waker, POOL_LOAD)
    items = rt.enqueue([b"a", b"b"], None)
    rt.fail_cold(WorkerUnavailable("loading model 'sim' failed: out of memory"))
    for item in items:
        assert isinstance(item.reply.exception(), WorkerUnavailable)
    assert len(rt.queue) == 0
    clock.advance(10.0)
    rt.enqueue([b"c"], None)
    clock.advance(0.25)
    worker = fake_connection("sim-0.1", 100)
    worker.version = 2
    rt.add_worker(worker)
    assert cold_starts(metrics, POOL_LOAD) == (1.0, 0.25)  # measured from the held request after the failure


async def test_a_cold_start_whose_requests_all_expired_is_not_counted_in_the_next() -> None:
    """Held requests that all expire (504) while no worker comes end that cold start unmeasured: the next
    one is measured from its own first held request, not from the old one's, and nothing is shown held
    meanwhile."""
    waker = FakeWaker()
    rt, clock, metrics = cold_runtime(waker, POOL_LOAD)
    items = rt.enqueue([b"a"], clock.now() + 5.0)
    clock.advance(5.0)
    rt.expire(items)
    assert rt.statistics().detail.cold_for_s is None  # nothing is held
    clock.advance(100.0)
    rt.enqueue([b"b"], None)
    clock.advance(0.25)
    worker = fake_connection("sim-0.1", 100)
    worker.version = 2
    rt.add_worker(worker)
    assert cold_starts(metrics, POOL_LOAD) == (1.0, 0.25)


async def test_fail_cold_with_a_worker_in_service_leaves_the_queue_alone() -> None:
    rt, _, _ = cold_runtime(FakeWaker())
    worker = fake_connection("sim-0.1", 100)
    rt.add_worker(worker)
    items = rt.enqueue([b"a"], None)
    rt.fail_cold(WorkerUnavailable("late"))
    assert not items[0].reply.done() and len(rt.queue) == 1


async def test_a_stopping_runtime_refuses_even_with_a_waker() -> None:
    waker = FakeWaker()
    rt, _, _ = cold_runtime(waker)
    rt.stop(ServingError("bye"))
    with pytest.raises(WorkerUnavailable, match="shutting down"):
        rt.enqueue([b"a"], None)
    assert waker.wakes == []


async def test_the_waker_is_told_again_while_requests_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cold, "REWAKE_S", 0.001)
    waker = FakeWaker()
    rt, _, _ = cold_runtime(waker)
    task = asyncio.create_task(rt.run())
    try:
        rt.enqueue([b"a"], None)
        for _ in range(1000):
            if len(waker.wakes) >= 3:
                break
            await asyncio.sleep(0.001)
        assert len(waker.wakes) >= 3 and all(w[2] == 1 for w in waker.wakes)
        rt.add_worker(fake_connection("sim-0.1", 100))
        await asyncio.sleep(0.01)  # the timer sees a worker in service and stops
        told = len(waker.wakes)
        await asyncio.sleep(0.02)
        assert len(waker.wakes) == told
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_waker_registered_after_the_runtime_was_built_is_asked() -> None:
    wakers = Wakers()
    rt, _, _ = cold_runtime(None, wakers=wakers)
    with pytest.raises(WorkerUnavailable):
        rt.enqueue([b"a"], None)
    waker = FakeWaker()
    wakers.set("sim", waker, SCALE_FROM_ZERO)
    rt.enqueue([b"a"], None)
    assert len(waker.wakes) == 1


async def test_a_waker_that_fails_is_logged_and_the_request_stays_held(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(FakeWaker):
        def wake(self, model: str, version: int, waiting: int, oldest_age_s: float) -> None:
            raise RuntimeError("the pool is confused")

    rt, _, _ = cold_runtime(Broken())
    items = rt.enqueue([b"a"], None)  # the caller gets its items, to wait on and withdraw
    assert len(rt.queue) == 1 and not items[0].reply.done()
    assert "the waker of model sim failed" in caplog.text
    rt.withdraw(items)
    assert len(rt.queue) == 0
