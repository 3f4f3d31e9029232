"""The lease of single-actor decisions: the autoscaler, a rolling update, the canary judge. One front end
holds the lease "decider" at a time; its epoch goes with every write of such a decision (`fence=`), so a
deposed holder's late write is refused by the store (cluster/store.py's Fenced).

`LeaseKeeper` is the policy, a plain object on an injected clock: it is told of each try (`granted`,
`failed`, with the time the try started) and decides, as values, when to try next (`wait_s`: every
ttl/3, whether this front end holds the lease or waits for it) and whether this front end acts as the
holder now (`grant`). A holder that cannot renew stops acting within its lease time: `grant()` is None
once the time since the last successful acquire or renew *started* exceeds the ttl less a margin. The
store counts the lease from when it took the request, which is later than its start here: the store
never deems the lease expired (and grants it to another) while this front end still acts on it.

`keep_lease` is its asyncio driver (a loop calling `store.acquire`), and `LeaseCollector` its gauge,
`inferd_cluster_lease_holder` (1 on the holder).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from inferd.clock import Clock
from inferd.cluster.store import Grant, Store, StoreError

log = logging.getLogger("inferd.cluster")

LEASE = "decider"
"""The lease of the server's single-actor decisions."""
TTL_S = 5.0
"""The lease's time to live by default (`[cluster] lease_ttl_s`)."""
MARGIN = 0.1
"""The share of the ttl a holder gives up early: it stops acting at ttl * (1 - MARGIN) after the start
of its last successful renew (clock drift between the store and here, a slow write in flight)."""


class LeaseKeeper:
    """Whether this front end (`holder`) holds the lease `lease`, from the tries it was told of."""

    def __init__(
        self, holder: str, clock: Clock, ttl_s: float = TTL_S, lease: str = LEASE, margin: float = MARGIN
    ) -> None:
        if ttl_s <= 0 or not 0 <= margin < 1:
            raise ValueError(f"a lease needs a positive ttl and a margin within [0, 1), got {ttl_s}, {margin}")
        self.holder = holder
        self.clock = clock
        self.ttl_s = ttl_s
        self.lease = lease
        self.margin = margin
        self._grant: Grant | None = None
        self._since = 0.0
        """When the last successful acquire or renew started."""

    def grant(self) -> Grant | None:
        """The grant while this front end acts as the holder; None otherwise (never granted, another
        holds it, or no renew succeeded within ttl * (1 - margin) of its start)."""
        if self._grant is None:
            return None
        if self.clock.now() - self._since > self._grant.ttl_s * (1 - self.margin):
            return None
        return self._grant

    def granted(self, started_at: float, grant: Grant | None) -> None:
        """The store answered a try started at `started_at`: `grant`, or None (another holds it)."""
        before = self.grant()
        if grant is None:
            self._grant = None
        elif started_at >= self._since or self._grant is None:
            self._grant, self._since = grant, started_at
        now = self.grant()
        if (before is None) != (now is None) or (before and now and before.epoch != now.epoch):
            if now is not None:
                log.info("lease %r: held by this front end (%s), epoch %d", self.lease, self.holder, now.epoch)
            else:
                log.warning("lease %r: this front end (%s) no longer holds it", self.lease, self.holder)

    def failed(self, started_at: float) -> None:
        """A try started at `started_at` got no answer (the store is down): the grant, if any, lapses
        on its own (`grant`)."""
        if self._grant is not None and self.grant() is None:
            log.warning("lease %r: not renewed within its time: this front end stops acting as holder", self.lease)
            self._grant = None

    def dropped(self) -> Grant | None:
        """This front end gives the lease up (it stops): the grant to release, if it still holds one."""
        grant, self._grant = self.grant(), None
        return grant

    def wait_s(self) -> float:
        """How long until the next try: ttl/3 (a holder renews twice before its lease ends)."""
        return self.ttl_s / 3


async def keep_lease(keeper: LeaseKeeper, store: Store) -> None:
    """Until cancelled: try to acquire or renew every `keeper.wait_s()`; release the lease on the way out."""
    try:
        while True:
            started = keeper.clock.now()
            try:
                async with asyncio.timeout(keeper.wait_s()):
                    grant = await store.acquire(keeper.lease, keeper.holder, keeper.ttl_s)
            except (StoreError, TimeoutError):
                keeper.failed(started)
            else:
                keeper.granted(started, grant)
            await asyncio.sleep(keeper.wait_s())
    finally:
        grant = keeper.dropped()
        if grant is not None:  # the next holder need not wait out the ttl
            with contextlib.suppress(StoreError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await store.release(grant)


class LeaseCollector:
    """`inferd_cluster_lease_holder`: 1 while this front end acts as the holder."""

    def __init__(self, keeper: LeaseKeeper | None) -> None:
        self.keeper = keeper

    def collect(self) -> Iterator[Metric]:
        holds = self.keeper is not None and self.keeper.grant() is not None
        yield GaugeMetricFamily(
            "inferd_cluster_lease_holder",
            "1 while this front end holds the lease of the server's single-actor decisions",
            value=1.0 if holds else 0.0,
        )
