"""The inference server: model runtimes, the worker hub, the local supervisor, and their lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections import ChainMap
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from inferd.api.admin import AdminApi
from inferd.batching.dispatcher import ModelRuntime
from inferd.batching.retry import RetryBudget
from inferd.clock import Clock, MonotonicClock
from inferd.config import ModelConfig, ServerConfig
from inferd.errors import Internal, NotFound, ShuttingDown
from inferd.fleet.autoscaler import Autoscaler
from inferd.fleet.control import FleetControl
from inferd.fleet.scaling import ScalingLoop
from inferd.llm.model import is_llm
from inferd.llm.runtime import LLMRuntime
from inferd.llm.upstream import UpstreamRuntime, is_upstream
from inferd.observability.llm_metrics import LLMCollector
from inferd.observability.metrics import Metrics
from inferd.observability.upstream_metrics import UpstreamCollector, UpstreamMetrics
from inferd.worker.connection import WorkerConnection
from inferd.worker.hub import WorkerHub
from inferd.worker.supervisor import Supervisor

if TYPE_CHECKING:
    from inferd.fleet.ray_launcher import RayLauncher

log = logging.getLogger("inferd.server")


class InferenceServer:
    def __init__(
        self,
        config: ServerConfig,
        models: list[ModelConfig],
        clock: Clock | None = None,
        spawn_workers: bool = True,
    ) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.started_at = time.time()
        self.metrics = Metrics()
        self.models = {m.name: m for m in models}
        self.runtimes: dict[str, ModelRuntime] = {}
        self.llm_runtimes: dict[str, LLMRuntime] = {}
        """LLM models (token streams, driven by the engine in their workers) beside the batch models."""
        self.retry_budget = RetryBudget(self.clock, config.retry_budget_ratio, config.retry_budget_min_per_s)
        self.upstreams: dict[str, UpstreamRuntime] = {
            m.name: self._upstream(m) for m in models if is_upstream(m)
        }
        """LLM models served by external OpenAI-compatible engines (vLLM, SGLang, TGI): no workers here."""
        for m in (m for m in models if not is_upstream(m)):
            if is_llm(m):
                self.llm_runtimes[m.name] = LLMRuntime(
                    m,
                    self.clock,
                    self.metrics.for_llm(m.name),
                    self.retry_budget,
                    kill_worker=self.kill_worker,
                    heartbeat_timeout_s=config.heartbeat_timeout_s,
                )
                continue
            rt = ModelRuntime(
                m,
                self.clock,
                self.metrics.for_model(m.name),
                self.retry_budget,
                self.kill_worker,
                heartbeat_timeout_s=config.heartbeat_timeout_s,
            )
            self.runtimes[m.name] = rt
            self.metrics.track(rt)
        self._token = secrets.token_hex(16)
        join = config.join_token.get_secret_value() if config.join_token else ""
        self.metrics.registry.register(LLMCollector(self.llm_runtimes.values))
        self.metrics.registry.register(UpstreamCollector(self.upstreams.values))
        self.hub = WorkerHub(
            ChainMap(self.runtimes, self.llm_runtimes),  # type: ignore[arg-type]
            self.clock,
            tokens=(self._token, join),
            load_timeout_s=config.worker_start_timeout_s,
        )
        self._socket_dir = tempfile.mkdtemp(prefix="inferd-")
        self.worker_address = f"unix:{os.path.join(self._socket_dir, 'workers.sock')}"
        self.supervisor = Supervisor(self.worker_address, self._token, config.log_level)
        self.ray_launcher: RayLauncher | None = None
        if config.ray_address:  # workers as Ray actors; they join over the TCP worker port
            from inferd.fleet.ray_launcher import RayLauncher

            self.ray_launcher = RayLauncher(
                config.ray_address, self._token, config.log_level, resource=config.ray_resource
            )
            self.supervisor = self.ray_launcher
        self.supervisor.restart_hooks.append(
            lambda slot: slot.model in self.runtimes and self.runtimes[slot.model].metrics.worker_restarted()
        )
        if spawn_workers:
            for m in (m for m in models if not is_upstream(m)):
                self.supervisor.add(m.name, config.workers if m.workers is None else m.workers)
        self.shutting_down = False
        self.hub.on_first_batch.append(lambda conn: self.supervisor.mark_healthy(conn.worker_id))
        token = config.admin_token.get_secret_value() if config.admin_token else None
        self.fleet = FleetControl(self)
        self.scaling = {
            m.name: ScalingLoop(self, m.name, Autoscaler(m.autoscale, self.clock))
            for m in models
            if m.autoscale
        }
        self.admin = AdminApi(self, token)
        self.admin_port: int | None = None
        self.worker_port: int | None = None

    def _upstream(self, m: ModelConfig) -> UpstreamRuntime:
        """An upstream-served model, with a retry budget of its own (its failures are its upstreams')."""
        budget = RetryBudget(self.clock, self.config.retry_budget_ratio, self.config.retry_budget_min_per_s)
        return UpstreamRuntime(m, self.clock, UpstreamMetrics(self.metrics, m.name), budget)

    @property
    def ready(self) -> bool:
        return (
            not self.shutting_down
            and all(rt.ready for rt in self.runtimes.values())
            and all(rt.ready for rt in self.llm_runtimes.values())
        )

    def runtime(self, name: str, version: str | None = None) -> ModelRuntime:
        rt = self.runtimes.get(name)
        if rt is None:
            raise NotFound(f"unknown model {name!r}; served models: {sorted(self.runtimes)}")
        if version is not None and version != str(rt.served_version):
            raise NotFound(f"model {name!r} version {version!r} is not served (served: {rt.served_version})")
        return rt

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Start listening for workers, the dispatch loops and the local workers; stop them on exit."""
        await self.hub.listen_unix(self.worker_address[len("unix:") :])
        if self.config.admin_port is not None:
            self.admin_port = await self.admin.start(self.config.admin_host, self.config.admin_port)
        if self.config.worker_port is not None:
            self.worker_port = await self.hub.listen_tcp(self.config.worker_host, self.config.worker_port)
            log.info("workers on other hosts connect at %s:%d", self.config.worker_host, self.worker_port)
        if self.ray_launcher is not None:  # Ray actors join over TCP (a free port unless one is set)
            from inferd.fleet.ray_launcher import check_reachable

            await check_reachable(self.ray_launcher.ray_address)  # fails startup: the server exits
            if self.worker_port is None:
                self.worker_port = await self.hub.listen_tcp(self.config.worker_host, 0)
            self.ray_launcher.address = f"{self.config.worker_host}:{self.worker_port}"
        log.info("serving models %s; workers connect at %s", sorted(self.runtimes), self.worker_address)
        try:
            async with asyncio.TaskGroup() as tg:
                loops = [
                    tg.create_task(self._dispatch(rt), name=f"dispatch-{rt.name}")
                    for rt in self.runtimes.values()
                ]
                loops += [
                    tg.create_task(rt.watchdog(), name=f"watchdog-{rt.name}") for rt in self.runtimes.values()
                ]
                loops += [
                    tg.create_task(up.run(), name=f"upstream-{name}") for name, up in self.upstreams.items()
                ]
                loops += [
                    tg.create_task(llm.run(), name=f"llm-{name}") for name, llm in self.llm_runtimes.items()
                ]
                loops += [
                    tg.create_task(loop.run(), name=f"autoscale-{name}")
                    for name, loop in self.scaling.items()
                ]
                supervisor = tg.create_task(self.supervisor.run(), name="supervisor")
                try:
                    yield
                finally:
                    await self._shutdown(loops, supervisor)
        finally:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def kill_worker(self, worker: WorkerConnection) -> None:
        """Kill a hung or silent worker. A local child is SIGKILLed (SIGSTOP cannot block that); a remote
        one only loses its connection. Either way the broken connection recovers its batches."""
        if self.ray_launcher is not None:
            self.ray_launcher.kill(worker.worker_id)  # ray.kill: the actor may be on another host
        elif worker.pid in self.supervisor.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
        worker.writer.transport.abort()

    def find_worker(self, worker_id: str) -> tuple[ModelRuntime, WorkerConnection]:
        for rt in self.runtimes.values():
            for w in rt.workers:
                if w.worker_id == worker_id:
                    return rt, w
        raise NotFound(f"no connected worker {worker_id!r}")

    async def _dispatch(self, rt: ModelRuntime) -> None:
        try:
            await rt.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("dispatch loop of model %s failed", rt.name)
            rt.stop_accepting()
            rt.fail_all_queued(Internal(f"dispatch loop of model '{rt.name}' failed: {exc!r}"))
            raise

    async def _shutdown(self, loops: list[asyncio.Task[None]], supervisor: asyncio.Task[None]) -> None:
        self.shutting_down = True
        for rt in self.runtimes.values():
            rt.stop_accepting()
            rt.fail_all_queued(ShuttingDown(f"model '{rt.name}' is shutting down"))
        for up in self.upstreams.values():
            up.stop(ShuttingDown(f"model '{up.name}' is shutting down"))
        for llm in self.llm_runtimes.values():
            llm.stop(ShuttingDown(f"model '{llm.name}' is shutting down"))
        for task in loops:
            task.cancel()
        await self.hub.close()
        await self.admin.stop()
        supervisor.cancel()
        log.info("stopped")
