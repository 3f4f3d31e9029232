"""The composition root: the model kinds, the registry of served versions and their runtimes, the worker
hub, the launcher (local processes or Ray actors), fleet control, autoscaling, the admin API, and their
lifecycle. Everything else finds runtimes through `server.registry` and reads them through snapshots, and
finds workers in `server.directory` (runtime/membership.py), the one record of worker membership."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from inferd import tls
from inferd.api.admin import AdminApi, AdminTarget
from inferd.api.admin_gateway import GatewayView, tenants_page
from inferd.api.cache_hook import CacheHook
from inferd.api.console_feed import ConsoleFeed
from inferd.clock import Clock, MonotonicClock
from inferd.cluster.frontend import ClusterFrontend, Seat
from inferd.cluster.saved import restore
from inferd.config import ModelConfig, ServerConfig
from inferd.config.identity import frontend_id
from inferd.errors import ServingError, ShuttingDown
from inferd.fleet.control import FleetControl, repository_loader
from inferd.fleet.model_control import ModelControl
from inferd.fleet.pools import ServerPools, check_pooled
from inferd.fleet.scaling import ScalingLoops, scaling_loops
from inferd.frontends.channel import MAX_MESSAGE_BYTES
from inferd.frontends.metrics import exposition, serve_registry
from inferd.frontends.peers import peers_of
from inferd.frontends.plan import FrontendPlan, worker_sockets
from inferd.frontends.readiness import await_ready, ready_wait_s
from inferd.gateway.auth import tenant_counter
from inferd.gateway.canary_share import CanaryShare
from inferd.gateway.config import gateway_config
from inferd.gateway.fallback import check_fallbacks
from inferd.gateway.model_reload import ModelSettings, own_settings
from inferd.gateway.quota_metrics import QuotaCollector
from inferd.gateway.reload import Gateway
from inferd.gateway.shadow import Shadows
from inferd.gateway.traffic_control import Traffic
from inferd.kinds.builtin import builtin_kinds
from inferd.kinds.collectors import RuntimeCollector
from inferd.kinds.search.shared_indexes import SharedIndexes
from inferd.kinds.search.store import IndexStore
from inferd.observability.metrics import Metrics
from inferd.observability.slo_config import model_slos
from inferd.routing.retry import RetryBudget
from inferd.runtime.contract import Runtime
from inferd.runtime.hub import WorkerHub
from inferd.runtime.kinds import KindRegistry, RuntimeContext
from inferd.runtime.membership import WorkerDirectory
from inferd.runtime.readiness import models_ready, server_ready
from inferd.runtime.registry import ModelRegistry
from inferd.runtime.waking import Wakers
from inferd.wire.connection import WorkerConnection
from inferd.worker.launcher import Launcher, WorkerSlot
from inferd.worker.orphans import server_pids_env
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
        kinds: KindRegistry | None = None,
        frontend: FrontendPlan | None = None,
        seat: Seat | None = None,
    ) -> None:
        self.config = config
        self.frontend = frontend
        """This process's place among several front ends (`--frontends N`); None: the only one. Only
        the owner (index 0) runs the local workers and the autoscaler."""
        spawn_workers = spawn_workers and (frontend is None or frontend.is_owner)
        self.clock = clock or MonotonicClock()
        self.started_at = time.time()
        self.metrics = Metrics(model_slos(models), self.clock)
        self.kinds = kinds or builtin_kinds()
        loader = repository_loader(config.model_repo, config.model_overrides) if config.model_repo else None
        seat = seat or Seat()
        self.model_control = ModelControl(self, config)
        """Load and unload while serving (the repository API); "explicit": only --load-model's at start."""
        restored = restore(self.model_control.at_start_models(models), seat.saved, loader)  # started again: it serves what it served
        models = [*restored.models, *IndexStore(config.data_dir).stored({m.name for m in models})]
        for m in models:
            self.kinds.check(m)
        check_pooled(models, config)
        self.retry_budget = RetryBudget(self.clock, config.retry_budget_ratio, config.retry_budget_min_per_s)
        self.registry = ModelRegistry()
        follower = frontend is not None and not frontend.is_owner
        self.directory = WorkerDirectory(self.clock)
        self.wakers = Wakers()
        """Who wakes each model served on demand (runtime/waking.py): its batch runtimes hold requests then."""
        self.context = RuntimeContext(
            config, self.clock, self.metrics, self.retry_budget, self.kill_worker, self.directory,
            self.registry.get, follower, self.kinds.api_of, lambda: (self.cluster.store, self.cluster.me), self.wakers,
        )
        for m in models:
            self.registry.add(self.kinds.get(m.kind).make_runtime(m, self.context))
        restored.set_defaults(self.registry)
        owner = frontend is None or frontend.is_owner  # the local workers, the autoscaler, the pool metrics
        self.pools = ServerPools(config, self.registry, self.wakers, self.clock, self.metrics.registry, owner, lambda: not self.cluster.shared or self.cluster.versions.holds(), lambda: self.loads)
        self.metrics.registry.register(RuntimeCollector(self.registry, self.kinds))
        shares = frontend is not None or seat.store is not None  # other front ends share the state
        self.traffic = Traffic(self.registry, self.clock, self.metrics.traffic, follower=shares)
        """Canary and A/B splits of requests that name no version (gateway/traffic_control.py); shared
        with other front ends, the lease holder's decide (gateway/canary_share.py)."""
        contends = frontend is None or frontend.is_owner  # the first on its host contends for the lease
        self.cluster = cluster = ClusterFrontend(seat, self, self.clock, contends)
        """The served state (cluster/): versions, defaults, updates, config generation, load, the lease."""
        self.cluster.register(self.metrics.registry)
        self.loads = loads = self.cluster.load.loads
        bound = max(MAX_MESSAGE_BYTES, config.max_body_bytes + 2**20)  # a forwarded search write's body
        self.peers = peers_of(config, frontend, seat.members, bound)
        """The other front ends and the channel to them (frontends/peers.py); None: this one alone."""
        holding = cluster.keeper.grant if cluster.keeper is not None else lambda: None
        me, follows = cluster.me, cluster.follower
        self.canary = CanaryShare(cluster.store, follows, self.traffic, me, holding, self.clock) if shares else None
        self.index_sync = (
            SharedIndexes(cluster.store, follows, self, me, holding, self.clock, supervises=spawn_workers) if shares else None
        )
        """Several front ends: each serves the server's search indexes (the decider lease holder's)."""
        check_fallbacks((rt.config for rt in self.registry.defaults()), self._kinds_of, self.kinds)
        self.shadows = Shadows(self.registry, self.metrics.shadow_requests, config.shadow_max_in_flight, clock=self.clock)
        """Shadow copies of requests (a model's traffic.shadow): cancelled at shutdown."""
        gateway = gateway_config(config)
        self.cache = CacheHook(self.registry, self.metrics.cache, self.clock, gateway.redis_url, gateway.redis_timeout_ms)
        """The response cache's stores (api/cache_hook.py), one per cache-enabled model version."""
        settings = ModelSettings(
            self.registry, self.traffic, self.cache, config.model_overrides, own_settings(config), self.kinds
        )
        self.gateway = Gateway(config, self.model_control.names, context_lengths=self._context_lengths, models=settings)
        """Tenants and API keys (gateway/reload.py): the API's auth layer reads its current gate; a
        reload also re-reads the models' traffic and cache tables."""
        if frontend is not None and config.config_path is not None:  # restarted since a reload: the file now
            self.gateway.reload_or_log()
        self.tenant_requests = tenant_counter(self.metrics.registry)
        self.metrics.registry.register(QuotaCollector(lambda: self.gateway.quotas))
        self._token = frontend.token if frontend else secrets.token_hex(16)
        join = config.join_token.get_secret_value() if config.join_token else ""
        self.hub = WorkerHub(
            self.registry, self.clock, self.directory,
            tokens=(self._token, join),
            load_timeout_s=config.worker_start_timeout_s,
            silence_timeout_s=config.heartbeat_timeout_s,
        )
        self.hub.pool_links = self.pools
        self._socket_dir, self.worker_address, local_workers = worker_sockets(frontend)
        subreaper = frontend.parent_pid if frontend is not None else 0
        self.supervisor: Launcher[Any] = Supervisor(
            local_workers,
            self._token,
            config.log_level,
            extra_args=[*config.observability.worker_args(), *(["--reconnect"] if subreaper else []), *config.zone_args()],
            env=server_pids_env(os.getpid(), subreaper) if subreaper else None,
            adopt=bool(subreaper) and frontend is not None and frontend.is_owner,
        )
        """Several front ends: the local workers outlive an owner that dies, and the next one adopts
        them (worker/survivors.py); they exit once the server is gone (worker/orphans.py)."""
        self.ray_launcher: RayLauncher | None = None
        if config.ray_address:  # workers as Ray actors; they join over the TCP worker port
            from inferd.fleet.ray_launcher import RayLauncher

            self.ray_launcher = RayLauncher(
                config.ray_address,
                self._token,
                config.log_level,
                resource=config.ray_resource,
                ca_pem=tls.worker_ca_pem(config),
                insecure=config.insecure,
            )
            self.supervisor = self.ray_launcher
        self.supervisor.restart_hooks.append(self._count_restart)
        if seat.members is not None and frontend is None:  # on many hosts, local worker ids name their front end
            self.supervisor.prefix = f"{cluster.me.replace('/', '_')}:"
        local = [
            (m, 0 if m.pool else config.workers if m.workers is None else m.workers)
            for m in models
            if self.kinds.get(m.kind).has_workers
        ]
        self._local_workers = sum(n for _, n in local)
        """Local workers configured (the owner's; they join every front end)."""
        if spawn_workers:
            restored.add_slots(self.supervisor, local)
            self._local_workers = len(self.supervisor.slots)  # the restored slots, when restored
            self._local_workers += self.pools.add_slots(self.supervisor, config)
        self.shutting_down = False
        self.hub.on_first_batch.append(lambda conn: self.supervisor.mark_healthy(conn.worker_id))
        self.fleet = FleetControl(
            self.registry, self.supervisor, self, self.directory, loader, followers=self.cluster.versions,
            gate=self.cluster.versions.check_holder,
        )
        holds = self.cluster.versions.holds  # the scaling loops (and a model's, made afresh when loaded while serving)
        self.autoscaling = ScalingLoops(lambda only: scaling_loops(self.registry, self.fleet, self.clock, self.kinds, loads, holds, self.wakers, owner, only), self.wakers)
        self.console = ConsoleFeed(
            self.metrics.registry,
            lambda: [rt.statistics() for rt in self.registry],
            self.clock,
            time.time,
            extras=self._console_extras,
        )
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._gone: list[asyncio.Task[None]] = []
        """The tasks of versions no longer served (cancelled)."""
        self._group: asyncio.TaskGroup | None = None
        self.admin: AdminApi | None = None
        self.admin_port: int | None = None
        self.worker_port: int | None = None
        self.grpc_address: Callable[[], str | None] = lambda: None  # the gRPC API's HOST:PORT once bound (runner)

    @property
    def ready(self) -> bool:  # models served on demand never hold it down: runtime/readiness.py
        return not self.shutting_down and server_ready(self.registry, self.wakers.on_demand, self.model_control.unloaded)

    def begin_shutdown(self) -> None:
        """Readiness answers 503 from now on (SIGTERM's grace); requests are still served (a flag only)."""
        self.shutting_down = True

    async def metrics_text(self) -> bytes:
        """The exposition of /metrics: the whole server's, with several front ends (frontends/metrics.py)."""
        return await exposition(self.frontend, self.metrics.registry)

    def has_workers(self, kind: str) -> bool:
        return self.kinds.get(kind).has_workers

    def _console_extras(self) -> dict[str, Any]:
        """What /admin/tenants, /admin/traffic and /admin/pools show (needs the admin token with tenants)."""
        view, traffic = GatewayView(self.gateway, self.tenant_requests, self.cache.statistics), self.traffic.statistics()
        return {"tenants": tenants_page(view), "traffic": msgspec.to_builtins(traffic), **self.pools.view()}

    def _count_restart(self, slot: WorkerSlot) -> None:
        if slot.model in self.registry:
            self.metrics.worker_restarted(slot.model)

    # ---- lifecycle ------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Start listening for workers, the runtimes' loops and the local workers; stop them on exit."""
        await self.cluster.open()  # the served state's versions before workers join
        await self.hub.listen_unix(self.worker_address[len("unix:") :])
        if self.peers is not None:  # the others' forwarded search writes
            await self.peers.open()
        scraped = None
        if self.frontend is not None:  # the other front ends read this one's metrics here
            scraped = await serve_registry(
                self.frontend.metrics_path(self.frontend.index), self.metrics.registry
            )
        token = self.config.admin_token.get_secret_value() if self.config.admin_token else None
        self.admin = AdminApi(
            AdminTarget(
                self.registry, self.kinds, self.fleet, self.supervisor, self.retry_budget, self.autoscaling.loops,
                self.clock, self.kill_worker, self.directory, self._reload,
                gateway=GatewayView(self.gateway, self.tenant_requests, self.cache.statistics),
                traffic=self.traffic.statistics, loads=self.loads,
                frontend={"id": frontend_id(self.config), "zone": self.config.zone},
                decider=self.cluster.decider, cluster=self.cluster.view, grpc=lambda: self.grpc_address(),
                pools=self.pools.view,
            ),
            token,
        )
        if self.config.admin_port is not None:
            http_tls = tls.http_context(self.config)
            self.admin_port = await self.admin.start(self.config.admin_host, self.config.admin_port, http_tls)
        worker_tls = tls.worker_port_context(self.config) if self._joins_over_tcp else None
        if self.config.worker_port is not None:
            self.worker_port = await self.hub.listen_tcp(self.config.worker_host, self.config.worker_port, worker_tls)
            how = "TLS" if worker_tls else "plain TCP"
            log.info("workers on other hosts connect at %s:%d (%s)", self.config.worker_host, self.worker_port, how)
        if self.ray_launcher is not None:  # Ray actors join over TCP (a free port unless one is set)
            from inferd.fleet.ray_launcher import check_reachable

            await check_reachable(self.ray_launcher.ray_address)  # fails startup: the server exits
            if self.worker_port is None:
                self.worker_port = await self.hub.listen_tcp(self.config.worker_host, 0, worker_tls)
            self.ray_launcher.address = f"{self.config.worker_host}:{self.worker_port}"
        if self.frontend is None and self.ray_launcher is None and worker_tls is None:  # one per host, no TLS
            self.cluster.join_every_front_end(self.supervisor, self.worker_address, self.config)
        self._log_models()
        try:
            async with asyncio.TaskGroup() as tg:
                self._group = tg
                for rt in self.registry:
                    self._start(rt)
                loops = [tg.create_task(self.autoscaling.run(), name="autoscaling")]
                loops.append(tg.create_task(self.console.run(), name="console"))
                loops.append(tg.create_task(self.model_control.run(), name="model-control"))
                loops.append(tg.create_task(self.pools.run(), name="pools"))
                supervisor = tg.create_task(self.supervisor.run(), name="supervisor")
                if self.canary is not None:
                    await self.canary.open()
                loops += [tg.create_task(loop, name=name) for name, loop in self.cluster.loops().items()]
                if self.canary is not None:
                    loops.append(tg.create_task(self.canary.run(), name="canary-share"))
                if self.index_sync is not None:
                    loops.append(tg.create_task(self.index_sync.run(), name="index-share"))
                try:
                    if self.frontend is not None:  # one of several: listen once workers are here
                        await await_ready(lambda: models_ready(self.registry, self.model_control.unloaded), ready_wait_s(self._local_workers, self.config))
                    yield
                finally:
                    await self._shutdown(loops, supervisor)
        finally:
            self._group = None
            if scraped is not None:
                scraped.close()
            if self.frontend is None:  # several front ends share the parent's folder
                shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _kinds_of(self, name: str) -> set[str]:  # served, or loadable (explicit: in the repository, not loaded)
        return {rt.kind for rt in self.registry if rt.name == name} or {m.kind for m in self.model_control.at_start.get(name, ())}

    def _context_lengths(self) -> dict[str, int]:
        """Each LLM model's context length: the longest request it accepts (for tenants' token quotas)."""
        return self.kinds.context_lengths(self.registry)

    @property
    def _joins_over_tcp(self) -> bool:
        return self.config.worker_port is not None or self.ray_launcher is not None

    def _log_models(self) -> None:
        default = self.registry.default_version
        rows = [f"{rt.name} v{rt.version} ({rt.kind}{', default' if rt.version == default(rt.name) else ''})" for rt in self.registry]
        log.info("serving %d model version(s): %s; workers connect at %s", len(rows), "; ".join(rows), self.worker_address)

    def _start(self, rt: Runtime) -> None:
        if self._group is None:
            raise RuntimeError("the server is not running")
        self._tasks[(rt.name, rt.version)] = self._group.create_task(rt.run(), name=f"runtime-{rt.name}-v{rt.version}")

    def add_version(self, config: ModelConfig) -> Runtime:
        """Serve another version of a model beside the ones served (a rolling update's new version)."""
        self.kinds.check(config)
        check_pooled([config], self.config)
        rt = self.kinds.get(config.kind).make_runtime(config, self.context)
        self.registry.add(rt)
        self.pools.adopt(rt)
        if self._group is not None:  # else it starts with the others
            self._start(rt)
        if self.registry.versions(config.name) == [rt.version]:  # served anew: its scaling loop made afresh
            self.autoscaling.renew(config.name)
        return rt

    def remove_version(self, name: str, version: int, why: ServingError | None = None) -> None:
        """Stop serving one version (its workers are drained already): fail what it still holds with
        `why` (default: 503, no longer served)."""
        self.pools.unload(name, version)  # a pooled version: its pool's workers drain and unload it
        rt = self.registry.remove(name, version)
        self.directory.drop(name, version)
        rt.stop(why or ShuttingDown(f"model '{name}' version {version} is no longer served"))
        if (task := self._tasks.pop((name, version), None)) is not None:
            task.cancel()
            self._gone = [t for t in self._gone if not t.done()] + [task]  # the task group waits for it still

    async def _reload(self) -> Mapping[str, Any]:
        """POST /admin/reload: here (refused whole if invalid), then on every front end (cluster/reload.py)."""
        return await self.cluster.reload()

    def kill_worker(self, worker: WorkerConnection) -> None:
        """Kill a hung or silent worker. A local child is SIGKILLed (SIGSTOP cannot block that); a remote
        one only loses its connection. Either way the broken connection recovers its work."""
        self.supervisor.kill(worker.worker_id)  # SIGKILL, or ray.kill: the actor may be on another host
        worker.writer.transport.abort()

    async def _shutdown(self, loops: list[asyncio.Task[None]], supervisor: asyncio.Task[None]) -> None:
        self.shutting_down = True
        await self.shadows.close()
        await self.cache.close()
        for rt in self.registry:
            rt.stop(ShuttingDown(f"model '{rt.name}' is shutting down"))
        for task in [*loops, *self._tasks.values()]:
            task.cancel()
        await asyncio.wait(loops, timeout=2.0)  # the lease released (bounded), then the store closed
        await self.cluster.close()
        if self.peers is not None:
            self.peers.close()
        await self.hub.close()
        if self.admin is not None:
            await self.admin.stop()
        supervisor.cancel()
        _, stuck = await asyncio.wait([*loops, *self._tasks.values(), *self._gone, supervisor], timeout=10.0)
        if stuck:  # the task group waits for them: name them, so a shutdown that hangs says where
            log.error("shutdown: still waiting on %s", sorted(t.get_name() for t in stuck))
        log.info("stopped")
