"""`grpc.health.v1.Health` for the server (service "") and each model (its name), read from the live
state on every Check (nothing to keep in sync): "" is SERVING while the server is ready
(/v2/health/ready's 200) and NOT_SERVING once it is shutting down (SIGTERM's grace period); a model is
SERVING while its default version is ready and the server is not shutting down; any other name is
NOT_FOUND. Watch polls the same state every `poll_s` and sends each change. Health stays open when
tenants are configured, as the REST health routes do: probes carry no key.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferd.api.server_view import ServerView

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self, server: ServerView, poll_s: float = 1.0) -> None:
        self.server = server
        self.poll_s = poll_s

    def status(self, service: str) -> Status | None:
        """The service's status now (None: no such service)."""
        server = self.server
        if service == "":
            return SERVING if server.ready else NOT_SERVING
        if service not in server.registry:
            return None
        ready = server.registry.get(service).ready and not server.shutting_down
        return SERVING if ready else NOT_SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = self.status(request.service)
            if status is None:
                status = SERVICE_UNKNOWN
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(self.poll_s)
