"""What a front end that does not write a search index knows of it (`inferd serve --frontends N`).

Front end 0 (the owner) is the one writer of every shard's log: it assigns the shards to the replicas
and ships them the log (kinds/search/runtime.py). Every other front end (a follower) reads from the same
replica workers, which join every front end: a replica tells its reading front ends which shard it
serves and how far it has applied that shard's log (kinds/search/replica.py's notes: when they join, when a
shard is assigned, after every apply). The follower reads only from replicas whose note said they
serve the shard, preferring those that applied everything it knows of (the seqs below), exactly as the
owner prefers those that applied every acknowledged write. Plain objects, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferd.kinds.search.replicas import Replica, ReplicaPhase


class KnownSeqs:
    """Per shard, the last seq this front end knows was written: the highest a replica of the shard
    said it applied, or one the owner gave a write this front end forwarded. A search prefers replicas
    that applied these (its min_seq), as the owner's searches prefer those that applied its log."""

    def __init__(self, shards: int) -> None:
        self.seqs = [0] * shards

    def learn(self, shard: int, seq: int) -> bool:
        """A seq of `shard` heard of; True when it is news (the cached results are stale now)."""
        if not 0 <= shard < len(self.seqs) or seq <= self.seqs[shard]:
            return False
        self.seqs[shard] = seq
        return True

    def written(self, seqs: Sequence[int]) -> bool:
        """The owner's seqs in the answer to a forwarded write (one per shard); True when any is news."""
        news = [self.learn(shard, seq) for shard, seq in enumerate(seqs)]
        return any(news)

    def behind(self, wanted: Sequence[int]) -> dict[int, int]:
        """The shards whose known seq is under `wanted`'s (a search's min_seq), with the seq wanted."""
        return {s: seq for s, seq in enumerate(wanted) if s < len(self.seqs) and seq > self.seqs[s]}


@dataclass(frozen=True, slots=True)
class Note:
    """A replica's note to a follower: the shard it serves (-1 while it loads one) and its progress."""

    shard: int
    applied_seq: int
    documents: int


def take_note(replica: Replica, note: Note) -> bool:
    """Update the follower's view of `replica`; True when its calls in flight must fail: it loads a
    shard now, or serves another one, so what they asked of its old index will not be answered by it."""
    moved = note.shard < 0 or note.shard != replica.shard
    replica.shard = note.shard
    replica.phase = ReplicaPhase.SERVING if note.shard >= 0 else ReplicaPhase.ASSIGNING
    replica.applied_seq = note.applied_seq
    replica.documents = note.documents
    return moved and bool(replica.pending)
