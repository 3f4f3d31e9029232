"""Run the server under uvicorn (uvloop + httptools) until SIGINT/SIGTERM, then drain; SIGHUP reloads the
gateway's tenants and API keys from the --config file."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
import uvloop
from prometheus_client import CollectorRegistry

from inferd import tls
from inferd.api.app import Api, create_app
from inferd.api.asgi import AsgiApp
from inferd.api.door_policy import DoorCollector, DoorLimits, DoorPolicy
from inferd.api.frontdoor import front_door_protocol
from inferd.clock import MonotonicClock
from inferd.cluster.config import open_store, store_url
from inferd.cluster.frontend import Seat
from inferd.cluster.members import Membership, fingerprint, new_member
from inferd.cluster.saved import take
from inferd.config import ConfigError, ModelConfig, ServerConfig
from inferd.config.identity import admin_address, frontend_id
from inferd.frontends.plan import FrontendPlan
from inferd.grpc_edge.edge import GrpcEdge
from inferd.server import InferenceServer

log = logging.getLogger("inferd")


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a grace period on SIGTERM: `on_terminate` turns readiness to 503 at once,
    the listener keeps accepting and serving for `grace_s` so probes and load balancers see it, then
    uvicorn's own shutdown starts (stop accepting, finish in-flight requests, lifespan drain) and the
    process exits 0. Ctrl-C, or a second SIGTERM, ends the grace period at once.

    SIGHUP calls `on_hangup` (the gateway's reload) from the event loop, at the next tick.

    The gRPC edge (`grpc`), when there is one, starts once the lifespan startup has built the server,
    and stops first at shutdown (stop accepting, calls in flight finish within the HTTP side's graceful
    timeout), before the HTTP side and the lifespan drain: runtimes outlive gRPC calls. During SIGTERM's
    grace period its health answers NOT_SERVING, as /v2/health/ready answers 503."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_terminate: Callable[[], None],
        grace_s: float,
        on_hangup: Callable[[], None] | None = None,
        grpc: GrpcEdge | None = None,
    ) -> None:
        super().__init__(config)
        self.on_terminate = on_terminate
        self.grace_s = grace_s
        self.on_hangup = on_hangup
        self.grpc = grpc
        self.exit_at: float | None = None
        self._announced = False
        self._hangup = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's SIGINT/SIGTERM handlers, and SIGHUP's (restored on exit, as uvicorn does)."""
        if self.on_hangup is None or threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        previous = signal.signal(signal.SIGHUP, self.handle_hangup)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.grpc is None or self.should_exit:
            return
        try:
            await self.grpc.start()
        except RuntimeError as exc:  # grpcio's "Failed to bind": the port is taken or the host not ours
            log.error("gRPC API: cannot listen on port %s: %s", self.grpc.config.grpc_port, exc)
            await self.lifespan.shutdown()
            raise SystemExit(3) from None  # uvicorn's own exit status for a listener that failed

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.grpc is not None:
            await self.grpc.stop(self.config.timeout_graceful_shutdown or 30.0)
        await super().shutdown(sockets)

    def handle_hangup(self, sig: int, frame: FrameType | None) -> None:
        self._hangup = True  # a signal handler: the reload itself runs on the event loop (on_tick)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.exit_at is not None:
            super().handle_exit(sig, frame)
            return
        self.on_terminate()  # a signal handler: only flags are set here, the event loop does the rest
        self.exit_at = time.monotonic() + self.grace_s

    async def on_tick(self, counter: int) -> bool:
        if self._hangup and self.on_hangup is not None:
            self._hangup = False
            self.on_hangup()
        if self.exit_at is not None and not self._announced:
            self._announced = True
            log.info("SIGTERM: not ready; serving %.1f s more, then draining", self.grace_s)
        if self.exit_at is not None and time.monotonic() >= self.exit_at:
            self.should_exit = True
        return await super().on_tick(counter)


def front_door_options(cfg: ServerConfig, metrics: CollectorRegistry, app: AsgiApp) -> dict[str, Any]:
    """uvicorn.Config arguments of the front door: our HTTP/1.1 protocol with the connection caps,
    head and body deadlines, head size limits and admission rate of `cfg` (api/frontdoor.py), handing
    its requests to `app`; its counts go to `metrics`."""
    door = DoorPolicy(DoorLimits.of(cfg), MonotonicClock())
    metrics.register(DoorCollector(door))
    return {
        "http": front_door_protocol(door, app),
        "ws": "none",
        "timeout_keep_alive": cfg.keep_alive_timeout_s,
    }


def build_uvicorn(
    cfg: ServerConfig,
    models: list[ModelConfig],
    frontend: FrontendPlan | None = None,
    seat: Seat | None = None,
) -> tuple[uvicorn.Server, InferenceServer]:
    server = InferenceServer(cfg, models, frontend=frontend, seat=seat)
    api = Api(server)  # one per front end, shared by both edges: its fallbacks' breakers, its cache
    app = create_app(server, api)
    ucfg = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        loop="uvloop",
        lifespan="on",
        access_log=False,
        log_level=cfg.log_level.lower(),
        **front_door_options(cfg, server.metrics.registry, app),
        timeout_graceful_shutdown=30,
        backlog=4096,
        log_config=None,
        **tls.uvicorn_options(cfg),
    )
    # the front ends of one server share the gRPC port as they share the HTTP one (SO_REUSEPORT)
    edge = None if cfg.grpc_port is None else GrpcEdge(api, reuseport=frontend is not None and frontend.count > 1)
    userver = GracefulServer(
        ucfg, server.begin_shutdown, cfg.shutdown_grace_s, server.gateway.reload_or_log, edge
    )
    return userver, server


def run_server(cfg: ServerConfig, models: list[ModelConfig]) -> None:
    """One front end, this process (several: runner/parent.py)."""
    log_config(cfg, models)
    _run(cfg, models, None, None)


def log_config(cfg: ServerConfig, models: list[ModelConfig]) -> None:
    for m in models:  # tensors are long; batching settings mean nothing to other kinds
        skip = {"inputs", "outputs"} | m.unread_fields()
        log.info("model %s v%d: %s", m.name, m.version, m.model_dump_json(exclude=skip))
    # Components' tables are named, not dumped: [tenants.*] hold key digests, which stay out of logs.
    log.info("server config: %s; tables: %s", cfg.model_dump_json(exclude={"tables"}), sorted(cfg.tables))


def serve_frontend(
    cfg: ServerConfig, models: list[ModelConfig], plan: FrontendPlan, sock: socket.socket
) -> None:
    """One of several front ends (runner/parent.py), on its own SO_REUSEPORT socket, sharing the
    parent's store (cluster/local.py). The owner, started again, serves what it served (cluster/saved.py)."""
    log.info("front end %d of %d (pid %d) serving on port %d", plan.index, plan.count, os.getpid(), cfg.port)
    _run(cfg, models, plan, [sock])


def _run(
    cfg: ServerConfig, models: list[ModelConfig], plan: FrontendPlan | None, sockets: list[socket.socket] | None
) -> None:
    """The server on one event loop (uvloop), which opens its seat in the cluster first (the store's
    clients belong to the loop that uses them)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            seat = runner.run(seat_of(cfg, models, plan))
        except ConfigError as exc:  # the store fails its PING: refused with the fix
            log.error("%s", exc)
            raise SystemExit(2) from None
        userver, _ = build_uvicorn(cfg, models, plan, seat)
        _settle_heap()
        runner.run(userver.serve(sockets=sockets))


async def seat_of(cfg: ServerConfig, models: list[ModelConfig], plan: FrontendPlan | None) -> Seat:
    """This front end's seat: the store it shares (`[cluster] store` / `--store`; with --frontends N and
    none, the parent's), its id there, and what it served before a restart (the first on its host, which
    runs the local workers: cluster/saved.py); on a shared store, its record `frontend/<id>`
    (cluster/members.py). Alone with no store: a MemoryStore of its own."""
    store = await open_store(cfg, plan.store_path() if plan else None, plan.token if plan else "")
    if store is None:
        return Seat()
    index = plan.index if plan else 0
    if store_url(cfg) is None:  # one host: the front ends are named by their index
        me, named, count = str(index), index, plan.count if plan else 1
    else:  # many hosts: by --frontend-id, or its HTTP address (config/identity.py)
        me, named, count = frontend_id(cfg) + (f"/{index}" if plan else ""), -1, None
    members = None
    if store_url(cfg) is not None:  # one live front end per id: a second is refused (ConfigError)
        try:
            admin = admin_address(cfg)  # where the others forward changes to it
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        workers = f"{cfg.worker_host}:{cfg.worker_port}" if cfg.worker_port is not None else None
        record = new_member(
            me, f"{cfg.host}:{cfg.port}", fingerprint(models, cfg.model_repo), workers=workers, admin=admin,
            zone=cfg.zone,
        )
        members = Membership(store, record, MonotonicClock())
        await members.join()
    return Seat(store, me, named, count, await take(store, me) if index == 0 else {}, members)


def _settle_heap() -> None:
    # Long-lived objects (modules, config, app) leave the GC's view, and young-generation collections
    # run less often: per-request garbage is freed by reference counting, and each collection pass
    # would otherwise show up as a latency spike at thousands of requests per second.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
