"""The server's readiness (runtime/readiness.py): the AND over the model versions it keeps warm; a model
served on demand (a waker registered: a pooled model, a `min_workers = 0` one) and a model unloaded are not
counted. First the rule over stand-in runtimes, then real batch runtimes: one pooled through a real
PoolManager whose load failed (its backoff) or whose pool has no worker, one kept warm."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from inferd.clock import FakeClock
from inferd.config import ServerConfig
from inferd.config.pools import PoolConfig
from inferd.errors import WorkerUnavailable
from inferd.fleet.pools import ServerPools
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.models.sim import sim_config
from inferd.observability.metrics import Metrics
from inferd.pools.manager import PoolLink, PoolManager
from inferd.pools.metrics import PoolMetrics
from inferd.routing.retry import RetryBudget
from inferd.runtime.readiness import counted, models_ready, server_ready
from inferd.runtime.registry import ModelRegistry
from inferd.runtime.waking import POOL_LOAD, SCALE_FROM_ZERO, Wakers
from inferd.wire import protocol as p
from tests.fakes.worker import fake_connection
from tests.unit.test_cold_admission import FakeWaker


@dataclass
class Stand:
    """A runtime as the rule reads it: a name, a version, its own readiness."""

    name: str
    ready: bool
    version: int = 1


def never(model: str) -> bool:
    return False


# ---- the rule -----------------------------------------------------------------------------------------


def test_every_model_kept_warm_must_be_ready() -> None:
    assert server_ready([Stand("a", True), Stand("b", True)], never, set())
    assert not server_ready([Stand("a", True), Stand("b", False)], never, set())  # a crash loop, as before
    assert server_ready([], never, set())


def test_a_model_served_on_demand_is_not_counted_whatever_its_own_readiness() -> None:
    on_demand = {"pooled"}.__contains__
    runtimes = [Stand("a", True), Stand("pooled", False)]
    assert server_ready(runtimes, on_demand, set())
    assert not counted(runtimes[1], on_demand, set()) and counted(runtimes[0], on_demand, set())
    assert not server_ready([Stand("a", False), Stand("pooled", False)], on_demand, set())  # "a" still counts


def test_a_model_unloaded_or_loading_is_not_counted() -> None:
    assert server_ready([Stand("a", True), Stand("c", False)], never, {"c"})
    assert not server_ready([Stand("a", True), Stand("c", False)], never, {"other"})


def test_every_version_of_a_model_kept_warm_counts() -> None:
    assert not server_ready([Stand("a", True, 1), Stand("a", False, 2)], never, set())


def test_wakers_say_which_models_are_served_on_demand() -> None:
    wakers = Wakers()
    assert not wakers.on_demand("sim")
    wakers.set("sim", FakeWaker(), SCALE_FROM_ZERO)
    assert wakers.on_demand("sim") and not wakers.on_demand("other")
    wakers.clear("sim")
    assert not wakers.on_demand("sim")


# ---- real runtimes --------------------------------------------------------------------------------------


def runtime(name: str, clock: FakeClock, wakers: Wakers, **config: object) -> ModelRuntime:
    metrics = Metrics()
    return ModelRuntime(
        sim_config(name=name, max_wait_ms=0.0, **config),
        clock,
        metrics.for_model(name, 1),
        RetryBudget(clock),
        kill_worker=lambda w: None,
        wakers=wakers,
    )


def pool_manager(clock: FakeClock, workers: int) -> PoolManager:
    config = sim_config(name="pooled")
    return PoolManager(
        "p",
        PoolConfig(workers=workers, memory_budget_mb=1000.0),
        clock,
        lambda: [],
        lambda m, v: config if m == "pooled" else None,
        lambda m, v, exc: None,
        PoolMetrics(CollectorRegistry()),
    )


def test_a_pooled_model_in_its_load_backoff_is_not_ready_yet_the_server_is() -> None:
    clock, wakers = FakeClock(), Wakers()
    manager = pool_manager(clock, workers=1)  # its own worker: loads wait for it (no link yet)
    wakers.set("pooled", manager, POOL_LOAD)
    pooled, warm = runtime("pooled", clock, wakers), runtime("warm", clock, wakers)
    warm.add_worker(fake_connection("warm-0", 1, model="warm"))
    runtimes = [pooled, warm]
    assert pooled.ready and warm.ready  # the pooled one: on demand
    assert server_ready(runtimes, wakers.on_demand, set())

    link = PoolLink("w0", 7, "h", writer=None, connected_at=0.0, last_heard=0.0)  # type: ignore[arg-type]  # nothing is sent on a result
    manager.on_message(link, p.LoadResult("pooled", 1, ok=False, error="RuntimeError: no weights"))
    assert not pooled.ready  # its own readiness: the backoff runs
    why = manager.wakeable("pooled", 1)
    assert isinstance(why, WorkerUnavailable) and "no weights" in str(why) and why.retry_after_s == 1.0
    with pytest.raises(WorkerUnavailable, match="no weights") as refused:  # its requests: the 503
        pooled.precheck()
    assert refused.value.retry_after_s == 1.0  # with the backoff left as Retry-After
    assert server_ready(runtimes, wakers.on_demand, set())  # the server's: the pooled model is its own
    assert not models_ready(runtimes, set())  # a restarted front end among several would wait to listen

    clock.advance(1.5)  # the backoff ran out: served on demand again
    assert pooled.ready and server_ready(runtimes, wakers.on_demand, set())

    warm.on_worker_lost(warm.workers[0], "exited")  # the model kept warm lost its only worker: the server is not ready
    assert not warm.ready and not server_ready(runtimes, wakers.on_demand, set())


def test_a_pool_with_no_worker_holds_its_models_down_not_the_server() -> None:
    clock, wakers = FakeClock(), Wakers()
    manager = pool_manager(clock, workers=0)  # its workers are remote: none joined
    wakers.set("pooled", manager, POOL_LOAD)
    pooled = runtime("pooled", clock, wakers)
    assert not pooled.ready
    assert "pool 'p' has no worker" in str(manager.wakeable("pooled", 1))
    assert server_ready([pooled], wakers.on_demand, set()) and not models_ready([pooled], set())
    assert models_ready([pooled], {"pooled"})
    wakers.clear("pooled")  # the same runtime with no waker: kept warm, and not ready
    assert not server_ready([pooled], wakers.on_demand, set())


# ---- the server's pools: who is served on demand, and the index's reason ----------------------------------


def test_the_pools_register_their_models_as_served_on_demand_and_say_why_one_is_not_ready() -> None:
    clock, wakers, registry = FakeClock(), Wakers(), ModelRegistry()
    pooled = runtime("pooled", clock, wakers, pool="p", memory_mb=10.0)
    warm = runtime("warm", clock, wakers)
    warm.add_worker(fake_connection("warm-0", 1, model="warm"))
    registry.add(pooled)
    registry.add(warm)
    pools = ServerPools(
        ServerConfig(pools={"p": PoolConfig(workers=0, memory_budget_mb=100.0)}), registry, wakers, clock,
        CollectorRegistry(),
    )
    assert wakers.on_demand("pooled") and not wakers.on_demand("warm")
    assert not pooled.ready and server_ready(registry, wakers.on_demand, set())
    why = pools.unready("pooled", 1)  # the repository index's reason
    assert why is not None and "pool 'p' has no worker" in why
    assert pools.unready("warm", 1) is None and pools.unready("gone", 1) is None
    pooled.add_worker(fake_connection("pool-0/pooled:1", 2, model="pooled"))
    assert pools.unready("pooled", 1) is None  # a worker in service: whatever holds it down is not the pool
    registry.remove("pooled", 1)  # unloaded, then loaded again from a folder without `pool`
    again = runtime("pooled", clock, wakers)
    registry.add(again)
    pools.adopt(again)
    assert not wakers.on_demand("pooled")  # kept warm now: it counts in the server's readiness
    assert not server_ready(registry, wakers.on_demand, set())
