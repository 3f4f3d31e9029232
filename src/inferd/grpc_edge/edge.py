"""`GrpcEdge`: the gRPC listener beside the HTTP one, on `cfg.host:cfg.grpc_port` (TLS with the same
certificate and key as HTTP), serving Triton's inference service (grpc_edge/services.py),
grpc.health.v1 (grpc_edge/health.py) and server reflection, over the HTTP app's own `Api` (one per
front end: its fallbacks' breakers, its cache, its chain).

The runner starts it once the lifespan has built the server, and stops it first at shutdown: it stops
accepting, lets calls in flight finish within a grace, then the HTTP side and the lifespan drain, so
runtimes outlive gRPC calls (runner/__init__.py).

Listener options (the `[server]` grpc_* settings, config/ports.py): a request message larger than
grpc_max_message_bytes (None: max_body_bytes) is refused RESOURCE_EXHAUSTED by its size before it is
decoded; answers are bounded by the model, as on REST; keepalive pings and a maximum connection age
(so clients behind a load balancer spread over new front ends); SO_REUSEPORT only where the runner says
a server's front ends share the port (`--frontends N`).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inferd.api.app import Api
from inferd.api.middleware import Errors
from inferd.config import ServerConfig
from inferd.core.call import Layer
from inferd.grpc_edge.errors import GrpcErrors
from inferd.grpc_edge.health import Health
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.protos import grpc_service_pb2_grpc as pb_grpc
from inferd.grpc_edge.services import InferenceService

log = logging.getLogger("inferd.grpc")

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


def grpc_layers(api: Api) -> list[Layer]:
    """The HTTP chain (`Api.layers`) with gRPC's error layer in place of HTTP's."""
    return [GrpcErrors if layer is Errors else layer for layer in api.layers]


def server_options(cfg: ServerConfig, reuseport: bool) -> list[tuple[str, Any]]:
    """grpc.aio.server's channel arguments for `cfg`."""
    receive = cfg.grpc_max_message_bytes if cfg.grpc_max_message_bytes is not None else cfg.max_body_bytes
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", receive),
        ("grpc.max_send_message_length", -1),
        ("grpc.keepalive_time_ms", round(cfg.grpc_keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(cfg.grpc_keepalive_timeout_s * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 1 if reuseport else 0),
    ]
    if cfg.grpc_max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms", round(cfg.grpc_max_connection_age_s * 1000)))
        options.append(("grpc.max_connection_age_grace_ms", round(cfg.grpc_max_connection_age_grace_s * 1000)))
    return options


def credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """The HTTP listener's certificate and key (--ssl-certfile, --ssl-keyfile), or None: plain."""
    if cfg.ssl_certfile is None or cfg.ssl_keyfile is None:
        return None
    return grpc.ssl_server_credentials([(cfg.ssl_keyfile.read_bytes(), cfg.ssl_certfile.read_bytes())])


class GrpcEdge:
    def __init__(self, api: Api, reuseport: bool = False) -> None:
        self.api = api
        self.config = api.server.config
        self.reuseport = reuseport
        self.server: aio.Server | None = None
        self.service: InferenceService | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Listen and serve (on the running loop); returns the bound port (a free one for port 0)."""
        cfg = self.config
        assert cfg.grpc_port is not None  # the runner builds no edge with gRPC off
        server = aio.server(options=server_options(cfg, self.reuseport))
        self.service = InferenceService(self.api, grpc_layers(self.api))
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(Health(self.api.server), server)
        reflection.enable_server_reflection(SERVICE_NAMES, server)
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        address = f"{host}:{cfg.grpc_port}"
        creds = credentials(cfg)
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        await server.start()
        self.server, self.port = server, port
        log.info("gRPC API on %s:%d%s", host, port, " (TLS)" if creds else "")
        return port

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, and open streams stop reading requests; calls in flight (a stream's requests
        already read) have `grace_s` to finish, then are cancelled."""
        server, self.server = self.server, None
        if server is not None:
            if self.service is not None:  # open streams read no more requests: they end once answered
                self.service.drain_streams()
            await server.stop(grace_s)
            log.info("gRPC API stopped")
