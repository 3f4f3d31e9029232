"""Where a server listens besides its HTTP port, and its gRPC listener's settings.

The defaults follow Triton's convention, from the HTTP port alone: gRPC on the HTTP port + 1 (8001 for
8000) and the admin API on the HTTP port + 2 (8002), so servers on one host with HTTP ports at least 3
apart never clash, and the tools find a server's admin API from its HTTP address. Port 0 (a free port)
gives free ports for both, logged at start.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


def grpc_port_for(http_port: int) -> int:
    """The gRPC port when none is set: the HTTP port + 1 (8001 for 8000); 0 (a free port) for 0."""
    return 0 if http_port == 0 else http_port + 1


def admin_port_for(http_port: int) -> int:
    """The admin API's port when none is set: the HTTP port + 2 (8002 for 8000); 0 (a free port) for 0."""
    return 0 if http_port == 0 else http_port + 2


def default_grpc_port(fields: dict[str, Any]) -> int:
    """ServerConfig.grpc_port's default, from the HTTP port of the fields validated before it."""
    return grpc_port_for(fields.get("port", 8000))


def default_admin_port(fields: dict[str, Any]) -> int:
    """ServerConfig.admin_port's default, from the HTTP port of the fields validated before it."""
    return admin_port_for(fields.get("port", 8000))


PORTS_APART = 3
"""How far apart the HTTP ports of servers on one host must be with the default gRPC and admin ports."""


class GrpcSettings(BaseModel):
    """The `[server]` keys of the gRPC listener (KServe v2 / Triton's GRPCInferenceService, health,
    reflection) but its port (ServerConfig.grpc_port, which follows the HTTP port): ServerConfig
    inherits them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    grpc_keepalive_time_s: float = Field(default=60.0, gt=0.0, le=86_400.0)
    """The server pings an idle connection after this long without traffic (grpc.keepalive_time_ms)."""
    grpc_keepalive_timeout_s: float = Field(default=20.0, gt=0.0, le=3600.0)
    """A ping unanswered for this long closes the connection (grpc.keepalive_timeout_ms)."""
    grpc_max_connection_age_s: float | None = Field(default=None, gt=0.0, le=86_400.0 * 30)
    """A connection is asked to go away (GOAWAY) after this long, so clients behind a load balancer
    spread over new front ends (grpc.max_connection_age_ms); None: never."""
    grpc_max_connection_age_grace_s: float = Field(default=30.0, ge=0.0, le=86_400.0)
    """How long calls still running on a connection past its age may take before it is closed."""
    grpc_max_message_bytes: int | None = Field(default=None, ge=1024, le=2**31 - 1)
    """Largest request message; a larger one is refused with RESOURCE_EXHAUSTED by its size, before it
    is decoded. None: the same as max_body_bytes."""
    grpc_max_concurrent_rpcs: int = Field(default=4096, ge=1, le=1_000_000)
    """RPCs this front end runs at once (unary calls and open streams, over every connection); the next
    is refused RESOURCE_EXHAUSTED at once, before its handler runs: the gRPC twin of max_connections,
    which bounds the memory held by messages received and not yet answered."""
    grpc_max_streams_per_connection: int = Field(default=256, ge=1, le=100_000)
    """HTTP/2 streams (calls) one connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS);
    a client past it waits for one to end."""
    grpc_stream_max_in_flight: int = Field(default=64, ge=1, le=100_000)
    """Requests one ModelStreamInfer stream may have in flight; the next gets RESOURCE_EXHAUSTED."""
