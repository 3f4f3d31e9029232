"""The wire messages of search shard replicas (models of kind "search"), part of wire/protocol.py's
`Message`: one ShardAssign, then ShardCall / ShardReply (kinds/search/shipping.py, replica.py).
"""

from __future__ import annotations

import msgspec


class ShardAssign(msgspec.Struct, tag="shard_assign"):
    """Serve this shard, for the index's writer of lease epoch `epoch`: a replica that holds the shard
    with the same settings, applied within `base_seq`..`last_seq`, keeps its index; else it loads the snapshot
    sent (`snapshot`: a packed snapshot cut in pieces, every ShardAssign but the last with `more`), or
    starts empty when none is sent. It then answers ShardReply(call_id=0) with the seq it holds; the
    writer ships the log from there. An epoch older than one the replica accepted is refused (a deposed
    writer): the answer carries the error."""

    shard: int
    settings: bytes
    """The index settings (IndexSettings as MessagePack)."""
    epoch: int = 0
    base_seq: int = 0
    """The seq the writer's log starts after (its snapshot's): a replica behind it cannot keep its index."""
    last_seq: int | None = None
    """The writer's last seq when it sent this (None: not said): a replica past it applied entries this
    writer does not hold (a former writer's) and cannot keep its index either."""
    snapshot: bytes = b""
    more: bool = False
    reload: bool = False
    """Do not keep the index held even when it fits the log (it follows an older writer, whose entries
    may differ from this one's): load the snapshot sent, or start empty."""
    lineage: int = -1
    lineage_seq: int = 0
    """This writer's log continues the entries of the writer of epoch `lineage` up to `lineage_seq` (its
    takeover's source; -1: not said): a replica whose index was built under that writer keeps it only
    up to that seq, and one built under any other writer but this one does not keep it."""


class ShardCall(msgspec.Struct, tag="shard_call"):
    """One operation on the replica's shard, run in arrival order: "apply" (body: log entries, from the
    link that assigned the shard only), "search" (body: a ShardQuery), "get" (body: a document id),
    "snapshot" (body: an offset; answered with (seq, total size, the packed snapshot's bytes from the
    offset): the index packed when the offset is 0, the same blob sliced after)."""

    call_id: int
    op: str
    body: bytes = b""


class ShardReply(msgspec.Struct, tag="shard_reply"):
    call_id: int
    """The call answered; 0: the answer to ShardAssign."""
    applied_seq: int
    documents: int
    body: bytes = b""
    """The op's result as MessagePack (a ShardResult, a Document or None, the snapshot's seq)."""
    error: tuple[str, str] | None = None
    """(code, message) when the op failed."""
