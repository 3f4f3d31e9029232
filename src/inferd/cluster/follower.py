"""Every front end follows the shared documents with one loop: a notification from the store (watch)
wakes it at once, and a periodic read (every FOLLOW_EVERY_S) catches what a notification missed. Each
followed document has one applier, called with the document whenever its revision moved (and once at
start); appliers are registered by what owns the document (the served versions, the config generation,
the canary splits, a kind's own document), so the loop knows no kind.

A document is read and written through `Document`: one name, one msgspec type, one encoding (msgpack),
and writes that are compare-and-set on the revision read (`update`), fenced by a lease grant when a
single actor decides (cluster/lease.py).

While the store does not answer, every front end serves with the last state it read: `up` is False
(`inferd_cluster_store_up 0`), and the loop goes on trying; once it answers again the documents are read
again and applied, so the front ends converge with nothing lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import msgspec

from inferd.clock import Clock
from inferd.cluster.store import Grant, RevisionConflict, Store, StoreError, Versioned

log = logging.getLogger("inferd.cluster")

FOLLOW_EVERY_S = 0.5
"""The periodic read: a change whose notification was missed is applied within this long (the issue's
bound is 1 s)."""
CAS_ATTEMPTS = 20
"""`Document.update`'s retries on a concurrent writer before it gives up (RevisionConflict)."""

T = TypeVar("T")


class Document(Generic[T]):
    """One shared document: its name and its type (a msgspec Struct with defaults for every field, so
    that a document written by an older front end still decodes)."""

    def __init__(self, name: str, type_: type[T], empty: Callable[[], T]) -> None:
        self.name = name
        self.type = type_
        self.empty = empty
        """The value of a document never written."""
        self._decoder = msgspec.msgpack.Decoder(type_)

    def decode(self, found: Versioned | None) -> tuple[int, T]:
        """(revision, value); (0, empty) for a document never written."""
        if found is None:
            return 0, self.empty()
        return found.revision, self._decoder.decode(found.body)

    def encode(self, value: T) -> bytes:
        return msgspec.msgpack.encode(value)

    async def read(self, store: Store) -> tuple[int, T]:
        return self.decode(await store.read(self.name))

    async def update(
        self, store: Store, change: Callable[[T], T | None], fence: Grant | None = None
    ) -> tuple[int, T]:
        """Read, apply `change` (None: nothing to write) and write back compare-and-set on the revision
        read, again on a concurrent writer's conflict. (revision, value) as stored. Fenced (a deposed
        lease holder's write), StoreUnavailable, RevisionConflict after CAS_ATTEMPTS."""
        for _ in range(CAS_ATTEMPTS):
            revision, value = await self.read(store)
            changed = change(value)
            if changed is None:
                return revision, value
            try:
                return await store.write(self.name, self.encode(changed), expect=revision, fence=fence), changed
            except RevisionConflict:
                continue
        raise RevisionConflict(self.name, revision, -1)


Apply = Callable[[Versioned | None], Awaitable[None]]
"""An applier: takes the document as read (None: not written yet), applies it to this front end."""


class Follower:
    def __init__(self, store: Store, clock: Clock, every_s: float = FOLLOW_EVERY_S) -> None:
        self.store = store
        self.clock = clock
        self.every_s = every_s
        self.appliers: dict[str, Apply] = {}
        self.applied: dict[str, tuple[int, bytes]] = {}
        """Each document's revision and bytes last applied ((-1, b""): never). The bytes too: a store
        that lost its data (a Redis restarted empty) numbers revisions from 1 again."""
        self.up = True
        """Whether the store answered the last read (`inferd_cluster_store_up`)."""
        self.last_read_at: float | None = None
        self._wake = asyncio.Event()
        self._reading = asyncio.Lock()

    def follow(self, doc: str, apply: Apply) -> None:
        """Apply `doc` here whenever it changes (one applier per document)."""
        if doc in self.appliers:
            raise ValueError(f"document {doc!r} is followed already")
        self.appliers[doc] = apply
        self.applied[doc] = (-1, b"")

    async def read_all(self) -> bool:
        """Read every followed document and apply those that moved; False when the store did not answer
        (the last state read stays). Called at start, before this front end takes workers or requests."""
        async with self._reading:
            try:
                found = {doc: await self.store.read(doc) for doc in self.appliers}
            except StoreError as exc:  # down, or answering errors (READONLY, OOM): the last state stays
                if self.up:
                    log.warning("the cluster store does not answer (%s): serving the last state read", exc)
                self.up = False
                return False
            if not self.up:
                log.info("the cluster store answers again: applying its state")
            self.up = True
            self.last_read_at = self.clock.now()
            for doc, value in found.items():
                seen = (0, b"") if value is None else (value.revision, value.body)
                if seen == self.applied[doc]:
                    continue
                try:
                    await self.appliers[doc](value)
                except Exception:  # one document's bug must not stop the others from following
                    log.exception("applying the cluster document %r failed; it is tried again", doc)
                    continue
                self.applied[doc] = seen
            return True

    def changed(self) -> None:
        """A document changed (a notification, or this front end wrote one): read now."""
        self._wake.set()

    async def run(self) -> None:
        """Until cancelled: read on every notification and at least every `every_s`."""
        watch = asyncio.create_task(self._notifications(), name="cluster-watch")
        try:
            while True:
                await self.read_all()
                with contextlib.suppress(TimeoutError):  # asyncio.timeout, not wait_for: Python 3.11's
                    async with asyncio.timeout(self.every_s):  # wait_for loses a cancellation that comes
                        await self._wake.wait()  # as it times out, and this loop then never ended
                self._wake.clear()
                if (me := asyncio.current_task()) is not None and me.cancelling():
                    raise asyncio.CancelledError  # a call below ended as if it was not cancelled
                if watch.done():  # it ends only by a bug: raise it here
                    watch.result()
        finally:
            await _cancel_until_done(watch)

    async def _notifications(self) -> None:
        while True:
            try:
                async for doc in self.store.watch():
                    if doc in self.appliers:
                        self.changed()
            except StoreError:
                pass  # the periodic read goes on; watch again a moment later
            await asyncio.sleep(self.every_s)


async def _cancel_until_done(task: asyncio.Task[None]) -> None:
    """Cancel `task` until it ends. One cancellation is not always enough for a Redis watch: redis-py's
    pubsub read can end a cancelled read as "no message" (its own read timeout expiring as the cancellation
    arrives), and the watch would then go on for good, so a front end's shutdown waited on it forever."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.1)
