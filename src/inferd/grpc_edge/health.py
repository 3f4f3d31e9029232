"""`grpc.health.v1.Health` for the server (service "") and each model (its name), read from the live
state on every Check (nothing to keep in sync): "" is SERVING while the server is ready
(/v2/health/ready's 200) and NOT_SERVING once it is shutting down (SIGTERM's grace period); a model is
SERVING while its default version is ready and the server is not shutting down; any other name is
NOT_FOUND. Watch polls the same state every `poll_s` and sends each change; a stopping edge ends every
watch (`stop_watches`: its last status sent), which would otherwise hold the edge's grace to its end.

With tenants configured the server's health ("") stays open, as /v2/health/ready does: probes carry no
key. A model's tells which models are served and whether they are ready, as GET
/v2/models/{name}/ready does, so it asks what that route asks: a key (`authorization: Bearer KEY` or
`x-api-key`; else UNAUTHENTICATED, whatever the name), and a model its tenant may call (else
PERMISSION_DENIED, or NOT_FOUND naming only the tenant's models), with the REST twin's messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferd.api.http_call import key_from
from inferd.api.server_view import ServerView
from inferd.errors import ServingError
from inferd.gateway.auth import authenticate, check_model
from inferd.gateway.reload import Gate
from inferd.grpc_edge.calls import RpcMetadata
from inferd.grpc_edge.errors import code_of

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self, server: ServerView, gate: Callable[[], Gate] | None = None, poll_s: float = 1.0) -> None:
        self.server = server
        self.gate = gate
        """The current tenants and keys (None: none are ever configured)."""
        self.poll_s = poll_s
        self._stopping = asyncio.Event()
        """Set once the edge stops: every watch sends its last status and ends."""

    def stop_watches(self) -> None:
        """The edge stops: every Watch (and any opened from now on) sends its status and ends."""
        self._stopping.set()

    def check_caller(self, service: str, context: aio.ServicerContext[Any, Any]) -> None:
        """A model's health asks the caller what its ready route asks (with tenants: a key, and a model
        its tenant may call); the server's asks nothing. Raises the refusal."""
        if service == "" or self.gate is None:
            return
        gate = self.gate()
        if not gate.enforced:
            return
        tenant = authenticate(gate, key_from(RpcMetadata(context.invocation_metadata()).get))
        check_model(tenant, service, self.server.registry.names)

    async def _admit(self, service: str, context: aio.ServicerContext[Any, Any]) -> None:
        """The caller's refusal ends the call (context.abort raises)."""
        try:
            self.check_caller(service, context)
        except ServingError as exc:
            await context.abort(code_of(exc), exc.message)

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
        await self._admit(request.service, context)
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        await self._admit(request.service, context)
        last = None
        while True:
            status = self.status(request.service)
            if status is None:
                status = SERVICE_UNKNOWN
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            if self._stopping.is_set():
                return
            try:
                async with asyncio.timeout(self.poll_s):  # the next poll, or the edge stopping first
                    await self._stopping.wait()
            except TimeoutError:
                pass
