"""Several front ends (`--frontends N`): the way to the owner and what every front end keeps in step
over it, built and run together: the canary decisions (`traffic_sync.py`), the others' load for the
owner's autoscaler (`load_sync.py`), the model versions served (`version_sync.py`) and the config file's
reloads (`config_sync.py`). The search
indexes' sync (frontends/index_sync.py) uses the same channel."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from inferd.clock import Clock
from inferd.frontends.config_sync import ConfigSync
from inferd.frontends.load_sync import LoadSync
from inferd.frontends.owner_channel import MAX_MESSAGE_BYTES, OwnerChannel
from inferd.frontends.plan import FrontendPlan
from inferd.frontends.traffic_sync import TrafficSync
from inferd.frontends.version_sync import VersionSync
from inferd.gateway.traffic_control import Traffic
from inferd.runtime.registry import ModelRegistry


class FrontendSync:
    def __init__(
        self,
        plan: FrontendPlan,
        max_body_bytes: int,
        traffic: Traffic,
        registry: ModelRegistry,
        server: Any,
        clock: Clock,
    ) -> None:
        self.channel = OwnerChannel(plan, max(MAX_MESSAGE_BYTES, max_body_bytes + 2**20))
        """The others' way to the owner (a forwarded search write may be a whole request body)."""
        self.traffic = TrafficSync(plan, traffic, channel=self.channel)
        self.load = LoadSync(plan, registry, server.kinds, clock, self.channel)
        self.versions = VersionSync(plan, self.channel, server, clock)
        """`server`: the composition root (VersionSync says what of it it uses)."""
        has_file = server.config.config_path is not None
        self.config = ConfigSync(
            plan, self.channel, (lambda: server.gateway.reload()) if has_file else None, clock
        )
        """`server.gateway`: its config file's tenants, keys and models' tables (built after this)."""

    async def open(self) -> None:
        """Before the runtimes' loops: the canary state of the owner."""
        await self.traffic.open()

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The syncs' loops, by task name (each runs until cancelled)."""
        return {
            "traffic-sync": self.traffic.run(),
            "load-sync": self.load.run(),
            "version-sync": self.versions.run(),
            "config-sync": self.config.run(),
        }
