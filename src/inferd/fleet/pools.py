"""The server's pools: one PoolManager (pools/manager.py) per `[pools.NAME]`, wired to the rest.

`ServerPools` is what the composition root (server.py) holds:

* the start-time check of every pooled model against the pools (`check`: an unknown pool, a model bigger
  than its pool's budget);
* the hub's `PoolLinks`: a pool worker's pool link goes to its pool's manager;
* the `Waker` of each pooled model (runtime/waking.py `Wakers`, cause "pool_load"): its batch runtime
  holds its requests in the cold queue while no worker serves it, and wakes the manager;
* each manager's view of its pooled models, read from their runtimes' snapshots (waiting items, workers
  in service, batch cycle), and the hook that fails a model's held requests when its load fails
  (`ModelRuntime.fail_cold`);
* the local pool workers: `[pools.NAME] workers` slots in the launcher (`inferd worker --pool NAME`);
* `unload(model, version)` for the repository API, `unready(model, version)` for its index (why a
  pooled model is not ready: a load's backoff, no worker), and the `/admin/pools` view;
* with several front ends, who spreads hot models: the holder of the `decider` lease alone (`decides`),
  which counts in each model's queue what the others report queued (`others`: cluster/load.py's reports,
  read by the front end that contends for the lease), as its autoscaler does. Every front end asks the
  first loads of its own requests: two asking at once see the same PoolStates, pick the same worker
  (ties go to the lowest id) and that worker joins the second LoadModel to the first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from inferd.clock import Clock
from inferd.config import ConfigError, ModelConfig, ServerConfig
from inferd.config.pools import pool_refusals
from inferd.errors import NotFound, ServingError
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.kinds.batch.statistics import BatchStatistics
from inferd.pools.manager import PoolManager, ServedModel
from inferd.pools.metrics import PoolMetrics
from inferd.runtime.contract import Runtime
from inferd.runtime.frontend_load import FrontendLoads, ModelLoad
from inferd.runtime.registry import ModelRegistry
from inferd.runtime.waking import POOL_LOAD, Wakers
from inferd.wire import protocol as p
from inferd.worker.launcher import Launcher


def check_pooled(models: Iterable[ModelConfig], config: ServerConfig) -> None:
    """Every pooled model names a pool of this server and fits its budget: else ConfigError, naming
    the model, the key and the fix."""
    refusals = pool_refusals(models, config.pools)
    if refusals:
        raise ConfigError(refusals[0])


class ServerPools:
    def __init__(
        self,
        config: ServerConfig,
        registry: ModelRegistry,
        wakers: Wakers,
        clock: Clock,
        metrics: CollectorRegistry,
        export: bool = True,
        decides: Callable[[], bool] = lambda: True,
        others: Callable[[], FrontendLoads | None] = lambda: None,
    ) -> None:
        self.registry = registry
        self.others = others
        """The other front ends' latest load reports (None: none read here)."""
        self.wakers = wakers
        self.metrics = PoolMetrics(metrics if config.pools else None, export)
        self.managers = {
            name: PoolManager(
                name,
                pool,
                clock,
                lambda name=name: self._served(name),  # type: ignore[misc]
                self._config_of,
                self._fail_waiting,
                self.metrics,
                silence_timeout_s=config.heartbeat_timeout_s,
                spreads=decides,
            )
            for name, pool in sorted(config.pools.items())
        }
        for rt in registry:
            self.adopt(rt)

    def adopt(self, rt: Runtime) -> None:
        """A model version served (at start, or added since): a pooled one is woken by its pool; one no
        longer pooled (unloaded, then loaded from a folder without `pool`) is not, nor served on demand."""
        manager = self.manager_for(rt.config)
        if manager is not None:
            self.wakers.set(rt.name, manager, POOL_LOAD)
        elif (wake := self.wakers.of(rt.name)) is not None and wake.waker in self.managers.values():
            self.wakers.clear(rt.name)

    def manager_for(self, config: ModelConfig) -> PoolManager | None:
        """The manager of the pool that serves this model; None: it is not pooled."""
        return None if config.pool is None else self.managers.get(config.pool)

    def unload(self, model: str, version: int) -> list[str]:
        """The repository API's unload of a pooled model version: UnloadModel to every worker of its pool
        (each drains it first); returns the workers told ([] when the model is not pooled)."""
        try:
            manager = self.manager_for(self.registry.get(model, version).config)
        except NotFound:
            return []
        return [] if manager is None else manager.unload(model, version)

    def unready(self, model: str, version: int) -> str | None:
        """Why a pooled model version cannot be served on demand now (its pool has no worker, its last load
        failed and its backoff runs, it is bigger than every worker's budget); None: it can, or it is not
        pooled. The repository index's reason for such a model (its own readiness: runtime/readiness.py)."""
        try:
            rt = self.registry.get(model, version)
        except NotFound:
            return None
        manager = self.manager_for(rt.config)
        if manager is None or (isinstance(rt, ModelRuntime) and rt.ready_workers > 0):  # a stall: not the pool's
            return None
        why = manager.wakeable(model, version)
        return None if why is None else str(why)

    def add_slots(self, launcher: Launcher[Any], config: ServerConfig) -> int:
        """Each pool's local workers as launcher slots; returns how many."""
        return sum(len(launcher.add_pool(name, pool.workers)) for name, pool in sorted(config.pools.items()))

    async def run(self) -> None:
        """Every manager's timer, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            for name, manager in self.managers.items():
                tg.create_task(manager.run(), name=f"pool-{name}")

    def view(self) -> dict[str, Any]:
        return {"pools": [m.view() for m in self.managers.values()]}

    # ---- the hub's PoolLinks ----------------------------------------------------------------------------
    def refusal(self, pool: str) -> str | None:
        if pool in self.managers:
            return None
        defined = ", ".join(sorted(self.managers)) or "none"
        return f"this server has no pool {pool!r} (its pools: {defined}): start the worker with one of them as --pool"

    async def serve(self, hello: p.Hello, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.managers[hello.pool or ""].serve(hello, reader, writer)

    def close(self) -> None:
        for manager in self.managers.values():
            manager.close()

    # ---- what the managers read of the runtimes --------------------------------------------------------
    def _served(self, pool: str) -> list[ServedModel]:
        served = []
        for rt in self.registry:
            if rt.config.pool != pool:
                continue
            stats = rt.statistics()
            detail = stats.detail
            latency = detail.batch_latency_s if isinstance(detail, BatchStatistics) else None
            cycle = rt.config.max_wait_s + (latency or 0.0)
            served.append(ServedModel(rt.config, stats.queued, stats.ready_workers, cycle, self._elsewhere(rt)))
        return served

    def _elsewhere(self, rt: Runtime) -> int:
        """Items queued for the model version on the other front ends, as they last reported (0: none read)."""
        others = self.others()
        return 0 if others is None else others.total(ModelLoad(rt.name, rt.config.version)).queued_items

    def _config_of(self, model: str, version: int) -> ModelConfig | None:
        try:
            return self.registry.get(model, version).config
        except NotFound:
            return None

    def _fail_waiting(self, model: str, version: int, exc: ServingError) -> None:
        try:
            rt = self.registry.get(model, version)
        except NotFound:
            return
        if isinstance(rt, ModelRuntime):
            rt.fail_cold(exc)
