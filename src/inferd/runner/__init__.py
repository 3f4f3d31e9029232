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
from prometheus_client import CollectorRegistry

from inferd import tls
from inferd.api.app import create_app
from inferd.api.asgi import AsgiApp
from inferd.api.door_policy import DoorCollector, DoorLimits, DoorPolicy
from inferd.api.frontdoor import front_door_protocol
from inferd.clock import MonotonicClock
from inferd.cluster.local import LocalStoreClient
from inferd.cluster.saved import SavedModel, take
from inferd.cluster.store import Store
from inferd.config import ModelConfig, ServerConfig
from inferd.frontends.plan import FrontendPlan
from inferd.server import InferenceServer

log = logging.getLogger("inferd")


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a grace period on SIGTERM: `on_terminate` turns readiness to 503 at once,
    the listener keeps accepting and serving for `grace_s` so probes and load balancers see it, then
    uvicorn's own shutdown starts (stop accepting, finish in-flight requests, lifespan drain) and the
    process exits 0. Ctrl-C, or a second SIGTERM, ends the grace period at once.

    SIGHUP calls `on_hangup` (the gateway's reload) from the event loop, at the next tick."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_terminate: Callable[[], None],
        grace_s: float,
        on_hangup: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.on_terminate = on_terminate
        self.grace_s = grace_s
        self.on_hangup = on_hangup
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
    store: Store | None = None,
    saved: dict[str, SavedModel] | None = None,
) -> tuple[uvicorn.Server, InferenceServer]:
    server = InferenceServer(cfg, models, frontend=frontend, store=store, saved=saved)
    app = create_app(server)
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
    userver = GracefulServer(ucfg, server.begin_shutdown, cfg.shutdown_grace_s, server.gateway.reload_or_log)
    return userver, server


def run_server(cfg: ServerConfig, models: list[ModelConfig]) -> None:
    """One front end, this process (several: runner/parent.py)."""
    log_config(cfg, models)
    userver, _ = build_uvicorn(cfg, models)
    _settle_heap()
    userver.run()


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
    saved = asyncio.run(_saved(plan)) if plan.is_owner else {}
    store = LocalStoreClient(plan.store_path(), plan.token)
    userver, _ = build_uvicorn(cfg, models, plan, store, saved)
    log.info("front end %d of %d (pid %d) serving on port %d", plan.index, plan.count, os.getpid(), cfg.port)
    _settle_heap()
    userver.run(sockets=[sock])


async def _saved(plan: FrontendPlan) -> dict[str, SavedModel]:
    store = LocalStoreClient(plan.store_path(), plan.token)
    try:
        return await take(store, str(plan.index))
    finally:
        await store.close()


def _settle_heap() -> None:
    # Long-lived objects (modules, config, app) leave the GC's view, and young-generation collections
    # run less often: per-request garbage is freed by reference counting, and each collection pass
    # would otherwise show up as a latency spike at thousands of requests per second.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
