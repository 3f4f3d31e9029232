"""Who writes a search index: the holder of its lease `search-writer/<index>` in the cluster's store.

One lease per index covers all its shards' logs (a write spans shards and stays one write). Every front
end serving the index may contend for it (`contends`); the holder is the index's writer once it has
taken the shards over (kinds/search/takeover.py: each shard's state sourced from the freshest replica,
or its own log when that one is at least as far). `IndexWriter` is the policy, a plain object on an
injected clock, wrapping a LeaseKeeper (cluster/lease.py) for the grant: it is told of each try and of
the holder the store named, and answers, as values, whether this front end writes the index now
(`writes`), which front end does (`writer`: its id, None while none is known or a takeover runs), and
how long a refused write should wait (`retry_after_s`). A holder that cannot renew stops writing within
its lease time (the LeaseKeeper's rule), before the store gives the lease to another: a resumed old
writer finds its grant lapsed and refuses writes.

`keep_writer_lease` is its asyncio driver (acquire and renew, or read who holds it, every ttl/3).

The store also keeps the epoch of the last writer that finished a takeover (`kind/search/writer/<index>`,
written fenced by its grant: `record_writer`, read by `last_writer`): after a whole server restarted
(its replicas empty), only that writer's own log is the index, and a front end whose log is another's
never serves it as the index (kinds/search/takeover.py). A front end that cannot take the index over
stands down (`stand_down`: it lets the lease go and does not contend for a while) so another can.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec

from inferd.clock import Clock
from inferd.cluster.follower import Document
from inferd.cluster.lease import TTL_S, LeaseKeeper
from inferd.cluster.store import Grant, Store, StoreError

log = logging.getLogger("inferd.search")

WRITER_PREFIX = "search-writer/"
RECORD_PREFIX = "kind/search/writer/"


class WriterRecord(msgspec.Struct, frozen=True):
    """The last writer of an index that finished its takeover: its lease epoch and front end."""

    epoch: int = 0
    holder: str = ""


def writer_lease(index: str) -> str:
    """The name of the lease whose holder writes `index`'s logs."""
    return f"{WRITER_PREFIX}{index}"


def _record(index: str) -> Document[WriterRecord]:
    return Document(f"{RECORD_PREFIX}{index}", WriterRecord, WriterRecord)


async def last_writer(store: Store, index: str) -> WriterRecord:
    """The last writer that took `index` over (epoch 0: none recorded). StoreError."""
    return (await _record(index).read(store))[1]


async def record_writer(store: Store, index: str, grant: Grant) -> None:
    """Record the holder of `grant` as the index's writer; Fenced when the grant is no longer current."""
    doc = _record(index)
    await store.write(doc.name, doc.encode(WriterRecord(grant.epoch, grant.holder)), fence=grant)


class IndexWriter:
    """Whether this front end (`me`) writes the index `index`, and who does."""

    def __init__(self, index: str, me: str, clock: Clock, ttl_s: float = TTL_S, contends: bool = True) -> None:
        self.index = index
        self.clock = clock
        self.contends = contends
        """Whether this front end tries to take the lease (False: it only learns who holds it)."""
        self.keeper = LeaseKeeper(me, clock, ttl_s, lease=writer_lease(index))
        self._took_over: int | None = None
        """The epoch of the grant whose takeover finished (this front end writes while it holds it)."""
        self._other: tuple[str, float] | None = None
        """The other front end the store last named as the holder, and until when its grant runs."""
        self._quiet_until = -1.0
        """It stood down: it does not contend before this time."""

    @property
    def me(self) -> str:
        """This front end's id: the lease's holder when it holds it (the runtime sets it when it runs)."""
        return self.keeper.holder

    @me.setter
    def me(self, me: str) -> None:
        self.keeper.holder = me

    @property
    def lease(self) -> str:
        return self.keeper.lease

    @property
    def ttl_s(self) -> float:
        return self.keeper.ttl_s

    # ---- the answers -------------------------------------------------------------------------------
    def epoch(self) -> int | None:
        """The epoch of this front end's grant while it holds the lease; None otherwise."""
        grant = self.keeper.grant()
        return None if grant is None else grant.epoch

    def writes(self) -> bool:
        """This front end writes the index now: it holds the lease and its takeover is done."""
        epoch = self.epoch()
        return epoch is not None and epoch == self._took_over

    def taking_over(self) -> int | None:
        """The epoch of a grant held whose takeover has not finished (it must run); None otherwise."""
        epoch = self.epoch()
        return epoch if epoch is not None and epoch != self._took_over else None

    def writer(self) -> str | None:
        """The id of the front end that writes the index now: this one's when it `writes`, another's
        while the store's last word on it has not run out; None while none is known (the lease free, a
        takeover running, the store not answering)."""
        if self.writes():
            return self.me
        if self.epoch() is not None or self._other is None:
            return None
        holder, until = self._other
        return holder if self.clock.now() < until else None

    def retry_after_s(self) -> float:
        """How long a write refused while there is no writer should wait: about the lease's ttl."""
        return self.keeper.ttl_s

    # ---- what it is told ---------------------------------------------------------------------------
    def granted(self, started_at: float, grant: Grant | None) -> None:
        """The store answered a try to acquire or renew, started at `started_at`."""
        self.keeper.granted(started_at, grant)
        if grant is not None:
            self._other = None

    def failed(self, started_at: float) -> None:
        """A try got no answer: a grant held lapses on its own."""
        self.keeper.failed(started_at)

    def heard(self, started_at: float, grant: Grant | None) -> None:
        """The store named the lease's holder (`grant`, its ttl_s the time it had left), or none."""
        if grant is None or grant.holder == self.me:
            self._other = None
        else:
            self._other = (grant.holder, started_at + grant.ttl_s)

    def took_over(self, epoch: int) -> None:
        """The takeover under the grant of `epoch` finished: this front end writes while it holds it."""
        if self.epoch() == epoch:
            self._took_over = epoch
            log.info("index %s: written by this front end (%s), epoch %d", self.index, self.me, epoch)

    def contending(self) -> bool:
        """Whether to try for the lease now (it contends, and has not stood down lately)."""
        return self.contends and self.clock.now() >= self._quiet_until

    def grant(self) -> Grant | None:
        """The grant held (a takeover's record is fenced by it)."""
        return self.keeper.grant()

    def stand_down(self, for_s: float) -> Grant | None:
        """It could not take the index over: it does not contend for `for_s` (another may take the
        lease); the grant to release, if it holds one."""
        self._quiet_until = self.clock.now() + for_s
        log.warning("index %s: this front end (%s) stands down as its writer for %.1fs", self.index, self.me, for_s)
        return self.dropped()

    def dropped(self) -> Grant | None:
        """This front end stops: the grant to release, if it still holds one."""
        self._took_over = None
        return self.keeper.dropped()

    def wait_s(self) -> float:
        return self.keeper.wait_s()


async def keep_writer_lease(
    writer: IndexWriter, store: Store, changed: Callable[[], None] = lambda: None
) -> None:
    """Until cancelled: every ttl/3 acquire or renew the lease (when `contends`), and read who holds it
    when this front end does not; `changed()` after each try. Releases the lease on the way out."""
    try:
        while True:
            started = writer.clock.now()
            try:
                async with asyncio.timeout(writer.wait_s()):
                    if writer.contending():
                        writer.granted(started, await store.acquire(writer.lease, writer.me, writer.ttl_s))
                    if writer.epoch() is None:
                        writer.heard(started, await store.holder(writer.lease))
            except (StoreError, TimeoutError):
                writer.failed(started)
            changed()
            await asyncio.sleep(writer.wait_s())
    finally:
        grant = writer.dropped()
        if grant is not None:  # the next writer need not wait out the ttl
            with contextlib.suppress(StoreError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await store.release(grant)
