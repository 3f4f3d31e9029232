"""Several front ends (`--frontends N`): the way to the owner and what every front end keeps in step,
built and run together: over the owner channel, the others' load for the owner's autoscaler
(`load_sync.py`), the model versions served (`version_sync.py`) and the config file's reloads
(`config_sync.py`); through the store the parent serves (cluster/local.py), the canary decisions
(gateway/canary_share.py) and the search indexes (kinds/search/shared_indexes.py), on one follow loop.

Until the lease keeper (cluster/lease.py) is wired here, `OwnerLease` holds the "decider" lease for
front end 0, the one that contends on one host."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from inferd.clock import Clock
from inferd.cluster.follower import Follower
from inferd.cluster.local import LocalStoreClient
from inferd.cluster.store import Grant, Store, StoreError
from inferd.frontends.config_sync import ConfigSync
from inferd.frontends.load_sync import LoadSync
from inferd.frontends.owner_channel import MAX_MESSAGE_BYTES, OwnerChannel
from inferd.frontends.plan import FrontendPlan
from inferd.frontends.version_sync import VersionSync
from inferd.gateway.canary_share import CanaryShare
from inferd.gateway.traffic_control import Traffic
from inferd.kinds.search.shared_indexes import SharedIndexes
from inferd.runtime.registry import ModelRegistry

LEASE = "decider"
LEASE_TTL_S = 5.0


class OwnerLease:
    """The owner's hold on the "decider" lease, renewed every ttl/3; `grant()` is None on the others,
    and on the owner once it could not renew within the ttl (counted from the call that granted it)."""

    def __init__(self, store: Store, holder: str, contends: bool, clock: Clock) -> None:
        self.store, self.holder, self.contends, self.clock = store, holder, contends, clock
        self._grant: Grant | None = None
        self._until = 0.0

    def grant(self) -> Grant | None:
        return self._grant if self.clock.now() < self._until else None

    async def run(self) -> None:
        while self.contends:
            await self.renew()
            await asyncio.sleep(LEASE_TTL_S / 3)

    async def renew(self) -> None:
        started = self.clock.now()
        try:
            self._grant = await self.store.acquire(LEASE, self.holder, LEASE_TTL_S)
            self._until = started + LEASE_TTL_S if self._grant is not None else 0.0
        except StoreError:
            pass  # the grant held lapses at its time


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
        self.load = LoadSync(plan, registry, server.kinds, clock, self.channel)
        self.versions = VersionSync(plan, self.channel, server, clock)
        """`server`: the composition root (VersionSync says what of it it uses)."""
        has_file = server.config.config_path is not None
        self.config = ConfigSync(
            plan, self.channel, (lambda: server.gateway.reload()) if has_file else None, clock
        )
        """`server.gateway`: its config file's tenants, keys and models' tables (built after this)."""
        frontend = str(plan.index)
        self.store = LocalStoreClient(plan.store_path(), plan.token)
        self.follower = Follower(self.store, clock)
        self.lease = OwnerLease(self.store, frontend, plan.is_owner, clock)
        self.canary = CanaryShare(self.store, self.follower, traffic, frontend, self.lease.grant, clock)
        self.indexes = SharedIndexes(self.store, self.follower, server, frontend, plan.is_owner, clock)

    async def open(self) -> None:
        """Before this front end listens: the owner opens its channel; every front end reads the shared
        documents (the canary states, the owner's indexes)."""
        await self.channel.open()
        await self.follower.read_all()

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The syncs' loops, by task name (each runs until cancelled)."""
        return {
            "cluster-follow": self._follow(),
            "cluster-lease": self.lease.run(),
            "canary-share": self.canary.run(),
            "index-share": self.indexes.run(),
            "load-sync": self.load.run(),
            "version-sync": self.versions.run(),
            "config-sync": self.config.run(),
        }

    async def _follow(self) -> None:
        """The follow loop; when it ends (shutdown), the owner channel and the store close."""
        try:
            await self.follower.run()
        finally:
            self.channel.close()
            await self.store.close()
