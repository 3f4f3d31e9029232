"""A replica's side of its shard's writer changing hands (kinds/search/replica.py uses these):

- `WriterFence`: which front end writes the replica's shard: the link of the latest ShardAssign it
  accepted, under the highest lease epoch it has seen (kinds/search/writers.py). An assignment of an
  older epoch is refused, and so is an apply from any other link: a deposed writer that resumes (it was
  stopped while another took the lease over) neither reassigns the replica nor ships it entries.
- `keeps`: whether an assignment leaves the index held as it is: the same shard and settings, applied
  at least to the writer's snapshot and at most to its log's end (past it, the replica applied entries
  of a former writer that the new one does not hold: it must load the new writer's snapshot), and built
  under this writer, or under the one whose entries its log continues and no further than it took
  them (another writer's entries, and that one's past the takeover, may differ at the same seqs).
- `IncomingSnapshot`: the pieces of a snapshot arriving in ShardAssigns (`more`), joined per link.
- `OutgoingSnapshot`: the replica's index packed once for a "snapshot" call at offset 0, then read
  piece by piece by the writer (each answer at most snapshot.CHUNK_BYTES).

Plain objects, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from inferd.errors import BadRequest
from inferd.kinds.search.snapshot import CHUNK_BYTES
from inferd.wire import protocol as p


class WriterFence:
    def __init__(self) -> None:
        self.epoch = 0
        """The highest writer epoch accepted."""
        self.link: int | None = None
        """The link whose ShardAssign was accepted last (None: none, or it left)."""

    def admit(self, link: int, epoch: int) -> str | None:
        """A ShardAssign from `link` under `epoch`: None when accepted (that link writes from now on),
        else why it is refused."""
        if epoch < self.epoch:
            return f"a newer writer (epoch {self.epoch}) took the shard over: epoch {epoch} is deposed"
        self.epoch, self.link = epoch, link
        return None

    def writes(self, link: int) -> bool:
        return link == self.link

    def left(self, link: int) -> None:
        if self.link == link:
            self.link = None


def keeps(held: tuple[int, bytes, int, int] | None, msg: p.ShardAssign) -> bool:
    """Whether the index `held` (shard, settings, applied seq, the epoch of the writer it was built under;
    None: none) stays as it is under the assignment `msg` (its writer's log runs from its base_seq to its
    last_seq and continues the entries of the writer of epoch `lineage` up to `lineage_seq`)."""
    if held is None or msg.reload:
        return False
    shard, settings, applied, epoch = held
    if msg.lineage >= 0 and epoch != msg.epoch:  # built under another writer than this one
        if epoch != msg.lineage or applied > msg.lineage_seq:
            return False
    top = applied if msg.last_seq is None else msg.last_seq
    return (shard, settings) == (msg.shard, msg.settings) and msg.base_seq <= applied <= top


class IncomingSnapshot:
    def __init__(self) -> None:
        self._pieces: dict[int, list[bytes]] = {}

    def add(self, link: int, msg: p.ShardAssign) -> p.ShardAssign | None:
        """The whole assignment once its last piece came (the snapshot joined); None before."""
        pieces = self._pieces.setdefault(link, [])
        pieces.append(msg.snapshot)
        if msg.more:
            return None
        del self._pieces[link]
        return msgspec.structs.replace(msg, snapshot=b"".join(pieces), more=False)

    def left(self, link: int) -> None:
        self._pieces.pop(link, None)


class OutgoingSnapshot:
    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._seq = 0
        self._blob = b""

    def piece(self, offset: int, pack: Callable[[], tuple[int, bytes]]) -> tuple[int, int, bytes]:
        """(seq, total size, the bytes from `offset`): `pack()` (seq, blob) is called at offset 0."""
        if offset == 0:
            self._seq, self._blob = pack()
        elif not 0 < offset <= len(self._blob):
            raise BadRequest(f"no packed snapshot holds offset {offset}: read it again from 0")
        piece = self._blob[offset : offset + self.chunk_bytes]
        total = len(self._blob)
        if offset + len(piece) >= total:  # read whole: its memory goes
            self._blob = b""
        return self._seq, total, piece
