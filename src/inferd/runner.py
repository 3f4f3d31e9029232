"""Run the server under uvicorn (uvloop + httptools) until SIGINT/SIGTERM, then drain."""

from __future__ import annotations

import gc
import logging

import uvicorn

from inferd.api.app import create_app
from inferd.config import ModelConfig, ServerConfig
from inferd.server import InferenceServer

log = logging.getLogger("inferd")


def build_uvicorn(cfg: ServerConfig, models: list[ModelConfig]) -> tuple[uvicorn.Server, InferenceServer]:
    server = InferenceServer(cfg, models)
    app = create_app(server)
    ucfg = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level=cfg.log_level.lower(),
        timeout_keep_alive=30,
        timeout_graceful_shutdown=30,
        backlog=4096,
        log_config=None,
    )
    return uvicorn.Server(ucfg), server


def run_server(cfg: ServerConfig, models: list[ModelConfig]) -> None:
    for m in models:
        log.info("model %s v%d: %s", m.name, m.version, m.model_dump_json(exclude={"inputs", "outputs"}))
    log.info("server config: %s", cfg.model_dump_json())
    userver, _ = build_uvicorn(cfg, models)
    # Long-lived objects (modules, config, app) leave the GC's view, and young-generation collections
    # run less often: per-request garbage is freed by reference counting, and each collection pass
    # would otherwise show up as a latency spike at thousands of requests per second.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
    userver.run()
