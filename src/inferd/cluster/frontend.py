"""One front end's part in the served state, built and run together: the one follow loop
(cluster/follower.py), the lease where this front end contends for it (cluster/lease.py), the served
versions (cluster/served.py), the config generation (cluster/reload.py), the load reports
(cluster/load.py), and the worker slots of its launcher kept for its restart (cluster/saved.py).

Which store: with `--frontends N` on one host, the parent's (cluster/local.py), and only front end 0
contends for the lease (it runs the local workers, the admin API and the autoscaler); with one front end
and no shared store, a MemoryStore in this process: the same code path, at no cost per request (the loops
run every half second); on many hosts, the shared store, and every front end contends (`contends`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from inferd.clock import Clock
from inferd.cluster import saved
from inferd.cluster.config import cluster_config
from inferd.cluster.follower import Follower
from inferd.cluster.lease import LEASE, LeaseCollector, LeaseKeeper, keep_lease
from inferd.cluster.load import LoadReports
from inferd.cluster.members import Member, Membership
from inferd.cluster.memory import MemoryStore
from inferd.cluster.metrics import StoreCollector
from inferd.cluster.reload import ConfigReload, DivergedCollector
from inferd.cluster.saved import SavedModel
from inferd.cluster.served import REPORT_EVERY_S, SERVED, ServedVersions, changes
from inferd.cluster.store import Store, StoreError

log = logging.getLogger("inferd.cluster")

OPEN_TIMEOUT_S = 5.0
"""Most a starting front end waits for the store before it serves its config (the store down)."""


@dataclass(frozen=True, slots=True)
class Seat:
    """Where a front end sits in the cluster, as its runner opened it: the shared store (None: this front
    end alone, on a MemoryStore of its own), its id there, how many front ends the answers count (one
    host's N; None: those heard of), and what it served before a restart (cluster/saved.py)."""

    store: Store | None = None
    me: str = "0"
    index: int = 0
    """Its place among one host's N, as answers name it (-1 on many hosts: they name its id)."""
    count: int | None = 1
    saved: dict[str, SavedModel] = field(default_factory=dict)
    members: Membership | None = None
    """Its record among the front ends of a shared store (cluster/members.py), joined already."""


class ClusterFrontend:
    def __init__(self, seat: Seat, server: Any, clock: Clock, contends: bool) -> None:
        self.shared = seat.store is not None
        """Other front ends share the store (None: this one alone, on a MemoryStore of its own)."""
        self.store = store = seat.store if seat.store is not None else MemoryStore(clock)
        self.me = me = seat.me
        self.members = seat.members
        self.server = server
        """The composition root (ServedVersions says what of it it uses; its supervisor's slots too)."""
        self.follower = Follower(store, clock)
        ttl_s = cluster_config(server.config).lease_ttl_s  # [cluster] lease_ttl_s
        self.keeper = LeaseKeeper(me, clock, ttl_s) if contends else None
        self.versions = ServedVersions(store, me, server, clock, self.keeper, seat.index)
        if seat.members is not None:
            self.versions.refresh_members = seat.members.refresh
        has_file = server.config.config_path is not None
        self.config = ConfigReload(
            store, me, seat.index if seat.index >= 0 else me, seat.count,
            (lambda: server.gateway.reload()) if has_file else None,
        )
        """`server.gateway`: its config file's tenants, keys and models' tables (built after this)."""
        self.versions.config = self.config
        self.versions.control = server.model_control.share(self.versions) if self.shared else None
        """Model control: the holder loads and unloads, the others follow (fleet/control_share.py)."""
        self.load = LoadReports(store, me, server.registry, server.kinds, clock, seat.index, contends and self.shared)
        self.follower.follow(SERVED.name, self.versions.apply)
        self.versions.store_up = lambda: self.follower.up  # a change waits for a store that answers

    def register(self, metrics: CollectorRegistry) -> None:
        metrics.register(StoreCollector(lambda: self.follower.up))
        metrics.register(LeaseCollector(self.keeper))
        metrics.register(DivergedCollector(self.config))

    async def open(self) -> None:
        """Before this front end takes workers or requests: take or renew the lease (a front end started
        again renews its own), then serve what the served state says."""
        if self.keeper is not None:
            started = self.keeper.clock.now()
            try:
                async with asyncio.timeout(OPEN_TIMEOUT_S):
                    self.keeper.granted(started, await self.store.acquire(self.keeper.lease, self.me, self.keeper.ttl_s))
            except (StoreError, TimeoutError):
                self.keeper.failed(started)
        await self.follower.read_all()
        self.server.hub.before_refusal = self.follower.read_all
        if self.shared and self.keeper is not None and self.keeper.grant() is not None:
            with contextlib.suppress(StoreError):
                await self.config.started()

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The loops, by task name (each runs until cancelled)."""
        loops = {
            "cluster-follow": self.follower.run(),
            "cluster-served": self.versions.run(),
            "cluster-converge": self._converge(),
        }
        if self.shared:  # alone, nobody reads its load
            loops["cluster-load"] = self.load.run()
        if self.members is not None:
            loops["cluster-members"] = self.members.run()
        if self.keeper is not None:
            loops["cluster-lease"] = keep_lease(self.keeper, self.store)
            loops["cluster-slots"] = self._keep_slots()
        return loops

    async def decider(self) -> str | None:
        """The admin address of the front end that holds the lease, when another does (changes asked
        here go there: api/admin.py); None: here (this one holds it, or none is known: the change is
        then refused here while the lease is not held). ClusterUnavailable naming the store when it does
        not answer (served.changes)."""
        if self.members is None:
            return None
        holder = await self.decider_id()
        member = None if holder is None else self.members.members.get(holder)
        return None if member is None else member.admin

    async def decider_id(self) -> str | None:
        """The id of the front end that holds the lease, when another does (None: this one, or none is
        known). ClusterUnavailable naming the store when it does not answer (served.changes)."""
        if self.versions.holds():
            return None
        with changes():
            grant = await self.store.holder(LEASE)
        return None if grant is None or grant.holder == self.me else str(grant.holder)

    async def view(self) -> dict[str, Any]:
        """GET /admin/cluster: the live front ends (id, zone, addresses, host, pid), the lease's holder,
        and the model repositories when front ends differ (`repository_mismatch`: reported, never split
        silently); a front end with no shared store lists none (`shared` false)."""
        try:
            grant = await self.store.holder(LEASE)
        except StoreError:
            grant = None
        members = self.members.members if self.members is not None else {}
        mismatch = self.members.mismatch if self.members is not None else None
        return {
            "me": self.me,
            "shared": self.shared,
            "store_up": self.follower.up,
            "holder": None if grant is None else grant.holder,
            "frontends": [
                {"id": m.id, "zone": m.zone, "http": m.http, "workers": m.workers, "admin": m.admin,
                 "host": m.host, "pid": m.pid, "repository": m.repository}
                for _, m in sorted(members.items())
            ],
            "repository_mismatch": None if mismatch is None else {
                "message": mismatch.message(), **msgspec.to_builtins(mismatch)
            },
        }

    def join_every_front_end(self, launcher: Any, own: str, config: Any) -> None:
        """On a shared store, this front end's local workers (`launcher`: worker/launcher.py) join every
        live front end: their `--connect` is asked at each start (`Launcher.connect`: `own` and the
        others' worker addresses from their records), and they present the join token (from their
        environment: a command line is seen by every user of the host), which every front end accepts
        (plain TCP off loopback: `--insecure`, as the server was given). So all of
        them serve a rolling update's new version. Not without a join token (the others would refuse
        them), over TLS (they would not trust the others' certificates), nor with Ray: here only."""
        join = config.join_token.get_secret_value() if config.join_token else ""
        if self.members is None or not join:
            return
        launcher.connect = lambda: self.worker_addresses(own)
        launcher.token, launcher.env["INFERD_JOIN_TOKEN"] = "", join  # in their environment, not their argv
        launcher.extra_args += ("--insecure",) if config.insecure else ()

    def worker_addresses(self, own: str) -> str:
        return worker_addresses(own, self.me, self.members.members if self.members is not None else {})

    async def reload(self) -> Mapping[str, Any]:
        return await self.config.reload()

    async def close(self) -> None:
        """At a clean stop: leave the front ends (the id is free at once), then close the store."""
        if self.members is not None:
            await self.members.leave()
        with contextlib.suppress(StoreError):
            await self.store.close()

    async def _converge(self) -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            with contextlib.suppress(StoreError):
                await self.config.converge()

    async def _keep_slots(self) -> None:
        """Keep this front end's live worker slots in `local/<frontend>` (written when they changed, and
        again well within its ttl)."""
        kept, at = None, 0.0
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            now, clock = self._slots(), self.follower.clock.now()
            if now == kept and clock - at < saved.LOCAL_TTL_S / 4:
                continue
            try:
                await saved.save(self.store, self.me, now)
                kept, at = now, clock
            except StoreError:
                pass  # said by the follower's gauge; written once the store answers

    def _slots(self) -> dict[str, dict[int, list[int]]]:
        launcher, registry = self.server.supervisor, self.server.registry
        return {
            name: {v: [w.index for w in launcher.live_slots(name, v)] for v in registry.versions(name)}
            for name in self.versions.served()
        }


def worker_addresses(own: str, me: str, members: Mapping[str, Member]) -> str:
    """`own` (this front end's worker address) and every other live front end's (its record's
    `--worker-host:--worker-port`; one listening on every interface, 0.0.0.0 or ::, names no address
    to reach it by and is left out), comma-separated: where this front end's local workers join."""
    others = {m.workers for i, m in members.items() if i != me and m.workers and _reachable(m.workers)}
    return ",".join([own, *sorted(others)])


def _reachable(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        return bool(host)
