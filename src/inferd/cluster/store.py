"""The store that the front ends of one server share: a few versioned documents, leases with epochs, and
notifications of change. It knows no kind and no model: a document is a name and bytes.

Three implementations keep the same semantics (and pass the same tests, tests/unit/test_cluster_store.py):
- `MemoryState` (cluster/memory.py): the reference, a plain object on an injected clock; `MemoryStore`
  drives it in one process;
- the parent of `inferd serve --frontends N` serves a MemoryState to its front ends over its private Unix
  socket (cluster/local.py): one host needs no Redis;
- `RedisStore` (cluster/redis_store.py): front ends on many hosts.

Semantics:
- **Documents.** `write` stores a document's bytes and returns its new revision (1 for the first write,
  +1 on each). `expect` makes it compare-and-set: the write happens only when the document's revision is
  `expect` (0: it must not exist), else RevisionConflict. `ttl_s` makes it expire unless written again
  (a front end's load and its membership); without it, it stays.
- **Leases.** `acquire(lease, holder, ttl_s)` grants the lease when nobody holds it (or the holding
  expired): the epoch is one more than the lease's last one, and epochs never go back, even after the
  lease expired. The holder calls it again to renew (same epoch). `release` ends it early.
- **Fencing.** A write or delete with `fence=grant` happens only while that grant is the lease's
  current one (same holder and epoch, not expired): a deposed holder's late write raises Fenced.
- **Notifications.** `watch()` yields the names of documents written or deleted, as they happen. A
  watcher may miss some (a reconnect, a full queue): readers also read periodically.
- **Failure.** Every call raises StoreUnavailable when the store does not answer within its timeout.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import msgspec


class Versioned(msgspec.Struct, frozen=True):
    """A document as read: its revision (>= 1) and its bytes."""

    revision: int
    body: bytes


class Grant(msgspec.Struct, frozen=True):
    """A lease as granted: who holds it, its epoch, and for how long from the grant."""

    lease: str
    holder: str
    epoch: int
    ttl_s: float


class StoreError(Exception):
    """Something the store refused or could not do."""


class StoreUnavailable(StoreError):
    """The store did not answer (down, unreachable, or past its timeout)."""


class RevisionConflict(StoreError):
    """A compare-and-set whose expected revision is not the document's."""

    def __init__(self, doc: str, expected: int, actual: int) -> None:
        super().__init__(f"document {doc!r} is at revision {actual}, not {expected}")
        self.doc = doc
        self.expected = expected
        self.actual = actual


class Fenced(StoreError):
    """A write fenced by a lease grant that is no longer the lease's current one."""

    def __init__(self, grant: Grant, current: Grant | None) -> None:
        now = "nobody holds it" if current is None else f"{current.holder} holds epoch {current.epoch}"
        super().__init__(f"lease {grant.lease!r} epoch {grant.epoch} of {grant.holder} is over ({now})")
        self.grant = grant
        self.current = current


class Store(Protocol):
    async def read(self, doc: str) -> Versioned | None:
        """The document, or None when it does not exist (or expired)."""
        ...

    async def read_prefix(self, prefix: str) -> dict[str, Versioned]:
        """Every live document whose name starts with `prefix`, by name."""
        ...

    async def write(
        self, doc: str, body: bytes, *, expect: int | None = None, fence: Grant | None = None,
        ttl_s: float | None = None,
    ) -> int:
        """Store `body`; the new revision. RevisionConflict, Fenced (see the module's doc)."""
        ...

    async def delete(self, doc: str, *, fence: Grant | None = None) -> None:
        """Remove the document (nothing when it does not exist). Fenced."""
        ...

    async def acquire(self, lease: str, holder: str, ttl_s: float) -> Grant | None:
        """Take or renew the lease for `ttl_s`; None while another holds it."""
        ...

    async def release(self, grant: Grant) -> None:
        """End the grant now, if it is still the current one."""
        ...

    async def holder(self, lease: str) -> Grant | None:
        """The lease's current grant (with the time it had left as ttl_s), or None."""
        ...

    def watch(self) -> AsyncIterator[str]:
        """The names of documents written or deleted from now on (some may be missed)."""
        ...

    async def close(self) -> None: ...
