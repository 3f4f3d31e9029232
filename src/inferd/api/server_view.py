"""What the HTTP front end (app.py's create_app and Api) uses of the server that builds it: server.py's
InferenceServer implements this protocol, so api/ never imports the composition root above it."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol

from prometheus_client import Counter

from inferd.api.cache_hook import CacheHook
from inferd.api.console_feed import ConsoleFeed
from inferd.clock import Clock
from inferd.cluster.frontend import ClusterFrontend
from inferd.config import ServerConfig
from inferd.fleet.model_control import ModelControl
from inferd.frontends.peers import Peers
from inferd.gateway.reload import Gateway
from inferd.gateway.shadow import Shadows
from inferd.gateway.traffic_control import Traffic
from inferd.observability.metrics import Metrics
from inferd.runtime.kinds import KindRegistry
from inferd.runtime.registry import ModelRegistry


class ServerView(Protocol):
    config: ServerConfig
    clock: Clock
    registry: ModelRegistry
    kinds: KindRegistry
    metrics: Metrics
    cache: CacheHook
    shadows: Shadows
    traffic: Traffic
    gateway: Gateway
    console: ConsoleFeed
    model_control: ModelControl
    cluster: ClusterFrontend
    peers: Peers | None
    tenant_requests: Counter
    started_at: float
    shutting_down: bool

    @property
    def ready(self) -> bool: ...

    async def metrics_text(self) -> bytes: ...

    def running(self) -> AbstractAsyncContextManager[None]: ...
