"""A front end that gained an index's writer lease (kinds/search/writers.py) takes the index over before it
writes: for each shard it asks every live replica (they join every front end) how far it applied and
under which writer's epoch (every one must answer: a live one that does not, within ASK_S, holds the
takeover back, since it may be the one replica that applied an acknowledged entry); the freshest of those that follow the newest writer (an older writer's
replica may hold entries past the newest one's takeover that the newest never had), at seq m, is the
shard's state. It takes that replica's
index (packed, over the connection: shipping.fetch_snapshot), keeps it in its data_dir and starts its
own log afresh at m: its next entry is m + 1. Its own log is used instead only when it is at least as far
as every replica and as every seq it heard of, and was written under an epoch no older than the one the
replicas follow and the last writer's recorded in the store (a whole server started again: its replicas
start empty); an own log older than the last writer may hold entries that writer never had (never
acknowledged: no replica applied them), and lacks the ones it wrote, so it is not trusted then. A shard
with no source (no replica of the last writer answered, and its own log is not the last writer's or is
behind a seq this front end heard of) leaves the takeover unfinished: writes are refused, and the front
end stands down for a while so that another (the last writer, started again) can take the lease. Then every replica is assigned its shard again under the new epoch (replicas at m keep their
index, the others load the snapshot) and the front end writes.

`choose` is the rule, a plain function; `take_over` runs it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from inferd.cluster.store import Store, StoreError
from inferd.errors import ServingError
from inferd.kinds.search import wire
from inferd.kinds.search.follower import KnownSeqs
from inferd.kinds.search.replicas import Replica, ReplicaPhase
from inferd.kinds.search.shipping import Shipper, Writing, fetch_snapshot
from inferd.kinds.search.writers import last_writer, record_writer

log = logging.getLogger("inferd.search")

ASK_S = 5.0
"""The most a takeover waits for the replicas' answers. A live replica silent that long holds the takeover
back (it may hold acknowledged entries no other replica has): it is tried again later. A lost one (dead,
or killed once its heartbeats stop) is not waited for."""


@dataclass(frozen=True, slots=True)
class Heard:
    """A replica's answer: the shard it holds (-1: none), how far it applied, its writer's epoch."""

    replica: Replica
    shard: int
    applied_seq: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Source:
    """Where a shard's state comes from: a replica's index at `seq`, or (None) this front end's log."""

    shard: int
    replica: Replica | None
    seq: int
    replica_epoch: int = 0
    """The epoch of the writer the replica followed (its history is that writer's)."""


def choose(
    shard: int, heard: list[Heard], own_seq: int, own_epoch: int, known_seq: int, last_epoch: int = 0
) -> Source | str:
    """The source of `shard`'s state (`last_epoch`: the last writer's, as the store recorded it; 0: none);
    a string saying why there is none."""
    mine = [h for h in heard if h.shard == shard]
    best = max(mine, key=lambda h: (h.epoch, h.applied_seq), default=None)
    newest = max(last_epoch, best.epoch if best is not None else 0)
    top = best.applied_seq if best is not None else 0
    if own_seq >= max(top, known_seq) and own_epoch >= newest:
        return Source(shard, None, own_seq)
    if best is None or best.epoch < last_epoch:
        return (
            f"shard {shard}: no replica of the last writer (epoch {last_epoch}) answered, and this front "
            f"end's log (seq {own_seq}, epoch {own_epoch}) is not known to hold the index (seq {known_seq})"
        )
    return Source(shard, best.replica, best.applied_seq, best.epoch)


class Takeover(Writing, Protocol):
    known: KnownSeqs
    shipper: Shipper
    lease_store: Store


async def ask(rt: Takeover) -> tuple[list[Heard], list[Replica]]:
    """Every live replica's answer, and the live replicas that gave none within ASK_S (one that died
    meanwhile is neither)."""
    asked = [r for r in rt.replicas.values() if r.phase is not ReplicaPhase.GONE]
    answers = await asyncio.gather(*(_ask_one(rt, r) for r in asked))
    heard = [h for h in answers if isinstance(h, Heard)]
    return heard, [r for r, h in zip(asked, answers, strict=True) if h is SILENT]


SILENT = "silent"
"""A live replica's answer that did not come within ASK_S."""


async def _ask_one(rt: Takeover, replica: Replica) -> Heard | str | None:
    try:
        call_id, fut = rt.call(replica, "applied", b"")
    except ServingError:
        return None
    try:
        async with asyncio.timeout(ASK_S):
            reply = await fut
    except ServingError:  # it died, or the runtime stops
        return None
    except TimeoutError:
        return SILENT
    finally:
        rt.forget(replica, call_id)
    if reply.error is not None:  # it holds no shard yet
        return Heard(replica, -1, 0, 0)
    shard, epoch = wire.pair(reply.body)
    return Heard(replica, shard, reply.applied_seq, epoch)


async def take_over(rt: Takeover, epoch: int) -> str | None:
    """Source every shard's state for the grant of `epoch`; None once done (the replicas are assigned
    again), else why not (to be tried again)."""
    try:
        last = (await last_writer(rt.lease_store, rt.name)).epoch
    except StoreError as exc:
        return f"the last writer's record could not be read: {exc}"
    heard, silent = await ask(rt)
    if silent:  # alive (it heartbeats) but busy: it may hold acknowledged entries no other replica has
        names = ", ".join(r.worker_id for r in silent)
        return (
            f"replicas {names} did not say how far they applied within {ASK_S:.0f}s: the index is not taken "
            "over without them (they may hold acknowledged entries alone) until they answer or are lost"
        )
    own_epoch = rt.store.written_epoch(rt.name, rt.home)
    sources = [
        choose(s, heard, rt.logs[s].durable_seq, own_epoch, rt.known.seqs[s], last)
        for s in range(rt.params.shards)
    ]
    missing = [s for s in sources if isinstance(s, str)]
    if missing:
        return "; ".join(missing)
    lineage: dict[int, tuple[int, int]] = {}
    """Per shard, the writer whose entries the log continues (its epoch) and up to which seq."""
    for source in (s for s in sources if isinstance(s, Source)):
        if source.replica is None:
            lineage[source.shard] = (own_epoch, source.seq)
            continue
        try:
            seq = await rt.shipper.keep(source.shard, await fetch_snapshot(rt, source.replica))
        except (ServingError, TimeoutError) as exc:
            return f"shard {source.shard}: the snapshot of replica {source.replica.worker_id} failed: {exc}"
        await rt.logs[source.shard].rebase(seq)  # (seq: the snapshot's, at least what the replica said)
        lineage[source.shard] = (source.replica_epoch, seq)
        log.info(
            "index %s shard %d taken over at seq %d from replica %s",
            rt.name,
            source.shard,
            seq,
            source.replica.worker_id,
        )
    grant = rt.writer.grant()
    if grant is None or grant.epoch != epoch:
        return "the lease was lost during the takeover"
    await asyncio.to_thread(rt.store.save_written_epoch, rt.name, epoch, rt.home)
    try:  # fenced: a grant lost meanwhile records nothing
        await record_writer(rt.lease_store, rt.name, grant)
    except StoreError as exc:
        return f"the takeover could not be recorded: {exc}"
    rt.shipper.lineage = [lineage[shard] for shard in range(rt.params.shards)]
    for h in heard:  # what each replica said it holds: the assignment keeps it when it fits the log and
        followed, upto = lineage.get(h.shard, (-1, 0))  # came from the same writer's entries, no further
        fits = h.epoch == followed and h.applied_seq <= upto
        h.replica.shard, h.replica.applied_seq = h.shard, h.applied_seq if fits else -1
    return None
