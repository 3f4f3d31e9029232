"""The store's reference semantics (cluster/store.py's doc), as a plain object on an injected clock:
`MemoryState` takes each call and returns its outcome, with no I/O. `MemoryStore` drives one in this
process (tests, one front end); the parent of `--frontends N` serves one over its socket (cluster/local.py).
The Redis store implements the same semantics in Lua (cluster/redis_store.py) and passes the same tests."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

from inferd.clock import Clock
from inferd.cluster.store import Fenced, Grant, RevisionConflict, Versioned

WATCH_QUEUE = 1024
"""Notifications kept for a watcher that does not read: past it, the oldest are dropped (readers also
read periodically)."""


@dataclass(slots=True)
class _Doc:
    revision: int
    body: bytes
    expires_at: float


@dataclass(slots=True)
class _Lease:
    holder: str
    epoch: int
    expires_at: float


class MemoryState:
    """Documents and leases on `clock`. Plain: every method returns its outcome or raises its StoreError."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.docs: dict[str, _Doc] = {}
        self.leases: dict[str, _Lease] = {}
        self.epochs: dict[str, int] = {}
        """Each lease's last epoch, kept after the lease expires: epochs never go back."""

    def read(self, doc: str) -> Versioned | None:
        d = self._live(doc)
        return None if d is None else Versioned(d.revision, d.body)

    def read_prefix(self, prefix: str) -> dict[str, Versioned]:
        return {name: v for name in sorted(self.docs) if name.startswith(prefix) and (v := self.read(name))}

    def write(
        self, doc: str, body: bytes, expect: int | None = None, fence: Grant | None = None,
        ttl_s: float | None = None,
    ) -> int:
        self._check_fence(fence)
        d = self._live(doc)
        revision = 0 if d is None else d.revision
        if expect is not None and expect != revision:
            raise RevisionConflict(doc, expect, revision)
        # A document that expired and is written again goes on from its last revision: a reader that
        # saw revision N never sees N again for other bytes.
        last = self.docs[doc].revision if doc in self.docs else 0
        expires_at = math.inf if ttl_s is None else self.clock.now() + ttl_s
        self.docs[doc] = _Doc(max(revision, last) + 1, bytes(body), expires_at)
        return self.docs[doc].revision

    def delete(self, doc: str, fence: Grant | None = None) -> bool:
        """True when a live document was removed. Its last revision is kept, as for one that expired: a
        document deleted and written again goes on from it."""
        self._check_fence(fence)
        d = self._live(doc)
        if d is None:
            return False
        self.docs[doc] = _Doc(d.revision, b"", -math.inf)
        return True

    def acquire(self, lease: str, holder: str, ttl_s: float) -> Grant | None:
        now = self.clock.now()
        current = self._holding(lease)
        if current is not None and current.holder != holder:
            return None
        if current is None:
            epoch = self.epochs.get(lease, 0) + 1
            self.epochs[lease] = epoch
            current = self.leases[lease] = _Lease(holder, epoch, now + ttl_s)
        else:
            current.expires_at = now + ttl_s
        return Grant(lease, holder, current.epoch, ttl_s)

    def release(self, grant: Grant) -> None:
        current = self._holding(grant.lease)
        if current is not None and (current.holder, current.epoch) == (grant.holder, grant.epoch):
            del self.leases[grant.lease]

    def holder(self, lease: str) -> Grant | None:
        current = self._holding(lease)
        if current is None:
            return None
        return Grant(lease, current.holder, current.epoch, current.expires_at - self.clock.now())

    def _check_fence(self, fence: Grant | None) -> None:
        if fence is None:
            return
        current = self._holding(fence.lease)
        if current is None or (current.holder, current.epoch) != (fence.holder, fence.epoch):
            raise Fenced(fence, self.holder(fence.lease))

    def _holding(self, lease: str) -> _Lease | None:
        current = self.leases.get(lease)
        if current is not None and current.expires_at <= self.clock.now():
            del self.leases[lease]
            return None
        return current

    def _live(self, doc: str) -> _Doc | None:
        d = self.docs.get(doc)
        if d is not None and d.expires_at <= self.clock.now():
            return None
        return d


class MemoryStore:
    """A `Store` in this process over a MemoryState (notifications through per-watcher queues)."""

    def __init__(self, clock: Clock, state: MemoryState | None = None) -> None:
        self.state = state or MemoryState(clock)
        self._watchers: set[asyncio.Queue[str]] = set()

    async def read(self, doc: str) -> Versioned | None:
        return self.state.read(doc)

    async def read_prefix(self, prefix: str) -> dict[str, Versioned]:
        return self.state.read_prefix(prefix)

    async def write(
        self, doc: str, body: bytes, *, expect: int | None = None, fence: Grant | None = None,
        ttl_s: float | None = None,
    ) -> int:
        revision = self.state.write(doc, body, expect, fence, ttl_s)
        self.notify(doc)
        return revision

    async def delete(self, doc: str, *, fence: Grant | None = None) -> None:
        if self.state.delete(doc, fence):
            self.notify(doc)

    async def acquire(self, lease: str, holder: str, ttl_s: float) -> Grant | None:
        return self.state.acquire(lease, holder, ttl_s)

    async def release(self, grant: Grant) -> None:
        self.state.release(grant)

    async def holder(self, lease: str) -> Grant | None:
        return self.state.holder(lease)

    def notify(self, doc: str) -> None:
        for queue in self._watchers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(doc)

    async def watch(self) -> AsyncIterator[str]:
        queue: asyncio.Queue[str] = asyncio.Queue(WATCH_QUEUE)
        self._watchers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(queue)

    async def close(self) -> None:
        self._watchers.clear()
