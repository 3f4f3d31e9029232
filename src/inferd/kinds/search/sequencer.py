"""The one writer of a shard: the front end's sequencer. It numbers the shard's log entries (1, 2, 3 ...
with no gaps), appends them to the shard's write-ahead log in data_dir with group commit (every entry
waiting while one write runs goes into the next write: one write and one fsync for all of them), and
only then answers the writers: an acknowledged write is on disk. The entries since the last snapshot
stay in memory (`tail`) to be shipped to replicas in seq order; a replica further behind than the tail
reloads the snapshot first.

Only the index's writer appends (kinds/search/writers.py): `gate` says why a write is refused while
this front end does not write the index (no lease, or its takeover still runs); a new writer `rebase`s
its log on the snapshot it took over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from inferd.errors import Internal, ServingError
from inferd.kinds.search.types import LogEntry, Op
from inferd.kinds.search.wal import WriteAheadLog

log = logging.getLogger("inferd.search")


def _open(_: int) -> ServingError | None:
    return None


class ShardLog:
    def __init__(self, shard: int, path: Path, gate: Callable[[int], ServingError | None] = _open) -> None:
        self.shard = shard
        self.gate = gate
        """Why a write is refused now (this front end does not write the shard), None when it is not."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.wal = WriteAheadLog(path)
        self.tail: list[LogEntry] = list(self.wal.read_from(0))
        """Entries not yet covered by a snapshot, in seq order."""
        self.durable_seq = self.wal.last_seq
        """The last seq on disk (every entry up to it is acknowledged or may be)."""
        self._next_seq = self.durable_seq + 1
        self._pending: list[tuple[list[Op], asyncio.Future[int]]] = []
        self._lock = asyncio.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"inferd-wal-{shard}")
        self.broken = ""
        """Why the log refuses writes (a failed write leaves its state unknown until a restart)."""
        self.closed: ServingError | None = None
        """Closed (its index deleted, or the server stopping): what a write still arriving gets."""
        self.writes = 0
        self.entries = 0

    @property
    def first_seq(self) -> int:
        """The oldest seq still in the tail (durable_seq + 1 when the tail is empty)."""
        return self.tail[0].seq if self.tail else self.durable_seq + 1

    async def append(self, ops: list[Op]) -> int:
        """Log `ops` as one entry; returns its seq once it is on disk (group commit)."""
        if self.closed is not None:
            raise self.closed
        if self.broken:
            raise Internal(f"shard {self.shard}'s log refuses writes: {self.broken}")
        if (refused := self.gate(self.shard)) is not None:
            raise refused
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        self._pending.append((ops, done))
        async with self._lock:  # whoever holds it writes everything pending, its own entry included
            if not done.done() and self._pending:
                batch, self._pending = self._pending, []
                refused = self.closed or self.gate(self.shard)
                if refused is not None:  # closed or deposed while this waited: nothing is written
                    for _, waiter in batch:
                        waiter.set_exception(refused)
                    return await done
                entries = [LogEntry(seq=self._next_seq + i, ops=ops) for i, (ops, _) in enumerate(batch)]
                self._next_seq += len(entries)
                write = loop.run_in_executor(self._thread, self.wal.append, entries)
                write.add_done_callback(lambda f: self._written(f, entries, [d for _, d in batch]))
                await asyncio.shield(write)  # a cancelled caller leaves the write to finish and answer
        return await done

    def _written(self, write: asyncio.Future[None], entries: list[LogEntry], waiters: list) -> None:
        exc = None if write.cancelled() else write.exception()
        if write.cancelled() or exc is not None:
            self.broken = f"write of seq {entries[0].seq}..{entries[-1].seq} failed: {exc!r}"
            log.error("shard %d: %s", self.shard, self.broken)
            for w in waiters:
                if not w.done():
                    w.set_exception(Internal(f"shard {self.shard}: {self.broken}"))
            return
        self.tail.extend(entries)
        self.durable_seq = entries[-1].seq
        self.writes += 1
        self.entries += len(entries)
        for w, entry in zip(waiters, entries, strict=True):
            if not w.done():
                w.set_result(entry.seq)

    def entries_after(self, seq: int, limit: int) -> Sequence[LogEntry] | None:
        """Up to `limit` durable entries after `seq`; None when the tail no longer holds seq + 1 (the
        replica must load the snapshot first)."""
        if seq >= self.durable_seq:
            return []
        start = seq + 1 - self.first_seq
        if start < 0:
            return None
        return self.tail[start : start + limit]

    async def snapshotted(self, seq: int, keep_after: int) -> None:
        """A snapshot holds everything up to `seq`: drop the log before it on disk, and the tail up to
        `keep_after` (the slowest connected replica's seq, so nobody connected must reload)."""
        if self.closed is not None:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self.wal.truncate_before, seq + 1)
        cut = min(seq, keep_after) + 1 - self.first_seq
        if cut > 0:
            del self.tail[:cut]

    async def rebase(self, seq: int) -> None:
        """Start the log afresh after `seq` (a takeover's snapshot holds everything up to it); an entry of
        its own past it was never acknowledged (no replica applied it) and goes."""
        async with self._lock:
            if self.closed is not None:
                raise self.closed
            await asyncio.get_running_loop().run_in_executor(self._thread, self.wal.reset, seq)
            self.tail, self.durable_seq, self._next_seq = [], seq, seq + 1
            self.broken = ""

    def close(self, refuse: ServingError) -> None:
        """Close the log once the write running (if any) is done; a write arriving later gets `refuse`
        (the index's deletion: 404; the server stopping: 503), never the executor's RuntimeError."""
        if self.closed is not None:
            return
        self.closed = refuse
        self._thread.submit(self.wal.close)
        self._thread.shutdown(wait=True)
