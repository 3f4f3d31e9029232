"""A search index's write and query paths (the API calls these; kinds/search/runtime.py holds the replicas).

Writes: the batch is checked whole (kinds/search/requests.py), embedded through the batcher, split by shard
(a hash of the id), and appended to each shard's log by the index's writer (the holder of its lease,
kinds/search/writers.py; fsync before going on). A write is acknowledged (200) once it is in the writer's
log on its disk AND a replica of each shard written, in another process, applied it: one on another host
than the writer's when the shard has a readable one there (waited for up to ACK_WAIT_S, then any
replica's apply counts). A write no replica applied within ACK_WAIT_S, or whose writer lost its lease
meanwhile, is answered 503 with Retry-After: it may or may not be written (a new writer takes the shards
over from the freshest replica; an entry no replica applied is not part of the index then). Reads prefer
replicas that applied every write acknowledged before they began: a search sees every write
acknowledged before it started (read-your-writes) while such a replica lives. A `min_seq` in the search
(the `seq` a write returned) asks for the same guarantee explicitly.

Reads: embed the query (unless lexical), scatter to one replica per shard (kinds/search/scatter.py), merge
each list across shards, fuse (reciprocal rank fusion), and cache complete answers by generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import time
from dataclasses import dataclass
from typing import Any, Protocol

from inferd.errors import NotFound, ServingError, WorkerUnavailable
from inferd.kinds.search import fusion, wire
from inferd.kinds.search.caches import LRU, CacheStatistics
from inferd.kinds.search.config import SearchParams
from inferd.kinds.search.embedder import Embedder, embed_text, unavailable
from inferd.kinds.search.follower import KnownSeqs
from inferd.kinds.search.hedge import HedgePolicy, HedgeStatistics
from inferd.kinds.search.reembed import Reembedder, ReembedStatistics
from inferd.kinds.search.replicas import ReplicaChooser
from inferd.kinds.search.requests import SearchRequest
from inferd.kinds.search.scatter import Scatter, ShardCalls
from inferd.kinds.search.sequencer import ShardLog
from inferd.kinds.search.store import IndexStore
from inferd.kinds.search.types import Delete, Document, Op, ShardHit, ShardQuery, Upsert
from inferd.kinds.search.writers import IndexWriter
from inferd.observability import tracing
from inferd.runtime.kinds import RuntimeContext

INGEST_TIMEOUT_S = 120.0
VISIBLE_WAIT_S = 2.0
ACK_WAIT_S = 10.0
"""The most a write waits for a replica's apply before it is answered 503 (not acknowledged)."""
FOLLOW_INTERVAL_S = 1.0
RESULT_CACHE_ENTRIES = 2048
EMBED_BUDGET_S = 0.25
"""Most a query waits for its vector (and at most half its time): an embedder slower than this counts as
overloaded, and the search goes on lexically (degraded: ["dense"])."""


class Cluster(ShardCalls, Protocol):
    name: str
    params: SearchParams
    logs: list[ShardLog]
    """The shards' logs (the writer's; another front end's are not written)."""
    follower: bool
    """This front end does not write the index now (it forwards writes)."""
    first_on_host: bool
    writer: IndexWriter
    known: KnownSeqs
    generation: int
    store: IndexStore

    def seq(self, shard: int) -> int: ...

    def appended(self, shard: int) -> None: ...

    def readable(self, shard: int) -> bool: ...

    async def wait_progress(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ServiceStatistics:
    searches: int
    degraded: int
    partial: int
    embedder: str
    hedge: HedgeStatistics
    query_vectors: CacheStatistics
    results: CacheStatistics
    choice_ties: int
    shard_failures: int
    reembed: ReembedStatistics | None


HOST = socket.gethostname()
"""This front end's host, as a replica's Hello names its own (`WorkerConnection.host`)."""


def shard_of(doc_id: str, shards: int) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "big") % shards


class IndexService:
    def __init__(self, cluster: Cluster, ctx: RuntimeContext) -> None:
        self.cluster = cluster
        self.params = cluster.params
        self.clock = ctx.clock
        self.embedder = (
            None
            if self.params.lexical_only or ctx.find_model is None
            else Embedder(self.params.embedder, self.params.dim, ctx.find_model, ctx.clock, api_of=ctx.api_of)
        )
        self.hedge = HedgePolicy(ctx.clock, self.params.shards)
        self.chooser = ReplicaChooser()
        self.scatter = Scatter(cluster, self.hedge, self.chooser, ctx.clock)
        self.results: LRU[tuple[Any, ...], dict[str, Any]] = LRU(RESULT_CACHE_ENTRIES)
        self.searches = self.degraded = self.partial = 0
        self.reembedder = (
            None
            if self.embedder is None or not cluster.first_on_host
            else Reembedder(
                cluster, self.embedder, self.scatter.ask, cluster.store, ctx.clock, self.results_changed
            )
        )
        """Moves the index's vectors to the embedder's served version when it changes (reembed.py)."""

    # ---- writes ----------------------------------------------------------------------------------------
    async def upsert(self, docs: list[Document]) -> list[int]:
        """Log the documents (replacing those with the same ids); the shards' seqs once durable."""
        try:
            vectors, next_vectors = await self._document_vectors(docs)
        except ServingError as exc:
            raise WorkerUnavailable(
                f"documents are embedded by {self.params.embedder!r}, which failed: {exc.message}; "
                "nothing was written, retry the batch"
            ) from None
        ops: dict[int, list[Op]] = {}
        for doc, vector, next_vector in zip(docs, vectors, next_vectors, strict=True):
            upsert = Upsert(doc=doc, vector=vector, next_vector=next_vector)
            ops.setdefault(shard_of(doc.id, self.params.shards), []).append(upsert)
        return await self._write(ops)

    async def _document_vectors(self, docs: list[Document]) -> tuple[list[Any], list[Any]]:
        """Each document's vector by the index's embedder version, and by a running re-embed's target."""
        none: list[bytes | None] = [None] * len(docs)
        if self.embedder is None:
            return none, none
        texts = [embed_text(d) for d in docs]
        deadline = self.clock.now() + INGEST_TIMEOUT_S
        target = self.embedder.target
        try:
            vectors: list[Any] = await self.embedder.documents(texts, deadline, self.embedder.version)
        except NotFound:
            if target is None:
                raise
            vectors = none  # the old version is retired: these wait for the re-embed's promote
        if target is None:
            return vectors, none
        return vectors, await self.embedder.documents(texts, deadline, target)

    def results_changed(self) -> None:
        self.cluster.generation += 1
        self.results.clear()

    async def delete(self, doc_id: str) -> list[int]:
        return await self._write({shard_of(doc_id, self.params.shards): [Delete(id=doc_id)]})

    async def _write(self, ops: dict[int, list[Op]]) -> list[int]:
        try:
            async with asyncio.TaskGroup() as tg:
                appends = {s: tg.create_task(self.cluster.logs[s].append(o)) for s, o in ops.items()}
        except* ServingError as group:  # a shard's refusal (its index deleted: 404), as the caller catches it
            raise group.exceptions[0] from None
        for shard in appends:
            self.cluster.appended(shard)
        self.results_changed()
        written = {s: t.result() for s, t in appends.items()}
        await self._until_acknowledged(written)
        return self.seqs()

    async def _until_acknowledged(self, written: dict[int, int]) -> None:
        """Until a replica of each shard written applied it (one on another host when there is one, for
        half the wait): the write is acknowledged then. WorkerUnavailable (503) when it is not within
        ACK_WAIT_S, or this front end stopped writing the index meanwhile."""
        deadline = self.clock.now() + ACK_WAIT_S
        remote_until = self.clock.now() + ACK_WAIT_S / 2
        writer = self.cluster.writer
        while writer.writes() and self.clock.now() < deadline:
            prefer = self.clock.now() < remote_until
            if all(self._acknowledged(s, seq, prefer) for s, seq in written.items()):
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, (remote_until if prefer else deadline) - self.clock.now())):
                    await self.cluster.wait_progress()
        if writer.writes() and all(self._acknowledged(s, seq, False) for s, seq in written.items()):
            return
        lost = "" if writer.writes() else ": this front end no longer writes the index"
        raise WorkerUnavailable(
            f"the write to index {self.cluster.name!r} was logged but no replica applied it in time{lost}; it "
            "may or may not be written: retry it (an upsert replaces, a delete of a deleted document is a 404)",
            writer.retry_after_s(),
        )

    def _acknowledged(self, shard: int, seq: int, prefer_remote: bool) -> bool:
        readable = [r for r in self.cluster.shard_replicas(shard) if r.readable]
        remote = [r for r in readable if r.conn.host != HOST] if prefer_remote else []
        return any(r.applied_seq >= seq for r in remote or readable)

    def seqs(self) -> list[int]:
        return [self.cluster.seq(s) for s in range(self.params.shards)]

    async def forwarded(self, seqs: list[int]) -> None:
        """A follower: the owner acknowledged a write this front end forwarded, with these seqs. Until a
        replica of each shard behind them applied them (bounded), as the owner's answer waited."""
        behind = self.cluster.known.behind(seqs)
        if self.cluster.known.written(seqs):
            self.results_changed()
        await self._until_visible(behind)

    async def follow_embedder(self) -> None:
        """A follower: queries are embedded by the version of the index's vectors, which the owner's
        re-embedder records in data_dir (kinds/search/reembed.py); looked at every second."""
        while self.embedder is not None:
            version, _ = self.cluster.store.embedder_versions(self.cluster.name)
            if self.cluster.follower and version is not None and version != self.embedder.version:
                self.embedder.promote(version)
                self.results_changed()
            await asyncio.sleep(FOLLOW_INTERVAL_S)

    async def _until_visible(self, written: dict[int, int], wait_s: float = VISIBLE_WAIT_S) -> None:
        """Until a replica of each shard written applied it (bounded: the write is durable anyway)."""
        try:
            async with asyncio.timeout(wait_s):
                while not all(self._applied(s, seq) for s, seq in written.items()):
                    await self.cluster.wait_progress()
        except TimeoutError:
            pass

    def _applied(self, shard: int, seq: int) -> bool:
        return any(r.readable and r.applied_seq >= seq for r in self.cluster.shard_replicas(shard))

    # ---- reads -----------------------------------------------------------------------------------------
    async def get(self, doc_id: str, deadline: float) -> Document:
        shard = shard_of(doc_id, self.params.shards)
        body = wire.encode(doc_id)
        answer = await self.scatter.ask(shard, "get", body, self.cluster.seq(shard), deadline)
        if answer is None:
            raise WorkerUnavailable(f"no replica of shard {shard} of index {self.cluster.name!r} answered")
        doc = wire.document(answer)
        if doc is None:
            raise NotFound(f"index {self.cluster.name!r} has no document {doc_id!r}")
        return doc

    async def search(self, req: SearchRequest) -> dict[str, Any]:
        started = time.perf_counter()
        self.searches += 1
        deadline = self.clock.now() + req.timeout_ms / 1000
        min_seq = req.min_seq or tuple(self.seqs())
        if req.min_seq and self.cluster.follower:  # a write through another front end: wait to hear of it
            await self._until_visible(self.cluster.known.behind(req.min_seq), self._wait_s(deadline))
        key = (self.cluster.generation, req.query, req.k, req.mode, req.filter_key)
        cached = self.results.get(key) if req.cache else None
        if cached is not None:
            return {**cached, "took_ms": _ms_since(started), "cached": True}
        mode, vector, degraded = await self._vector(req, deadline)
        query = ShardQuery(
            text=req.query, vector=vector, k=_shard_k(req.k, mode), mode=mode, filter=req.filter
        )
        results = await self.scatter.gather(query, min_seq, deadline)
        answered = [r for r in results if r is not None]
        if not answered:
            raise WorkerUnavailable(self._nobody_answered(req.timeout_ms))
        with tracing.span("inferd.search.fuse", mode=mode, shards=len(answered)):
            hits = self._fuse(mode, answered, req.k)
        body = {
            "hits": hits,  # ShardHits encode as {"id", "score", "title"}
            "coverage": {"shards": len(results), "answered": len(answered)},
            "degraded": degraded,
            "mode": mode,
        }
        if len(answered) < len(results):
            self.partial += 1
        elif not degraded and req.cache:
            self.results.put(key, body)
        return {**body, "took_ms": _ms_since(started)}

    async def _vector(self, req: SearchRequest, deadline: float) -> tuple[Any, bytes | None, list[str]]:
        """The mode to run, the query vector, and what is degraded."""
        if req.mode == "lexical" or self.embedder is None:
            if req.mode != "lexical" and self.embedder is None:
                if req.mode == "dense":
                    raise unavailable(ValueError(f"index {self.cluster.name!r} has no embedder"))
            return "lexical", None, []
        budget = min(EMBED_BUDGET_S, max(0.0, deadline - self.clock.now()) / 2)
        try:
            with tracing.span("inferd.search.embed", model=self.embedder.model):  # records a failure
                vector = await self.embedder.query(req.query, self.clock.now() + budget)
            return req.mode, vector, []
        except ServingError as exc:
            if req.mode == "dense":
                raise unavailable(exc) from None
            self.degraded += 1
            return "lexical", None, ["dense"]

    def _wait_s(self, deadline: float) -> float:
        """How long a search may wait for a replica to apply its min_seq: half its time, at most
        VISIBLE_WAIT_S."""
        return min(VISIBLE_WAIT_S, max(0.0, deadline - self.clock.now()) / 2)

    def _fuse(self, mode: str, answered: list[Any], k: int) -> list[ShardHit]:
        lexical = fusion.merge([r.lexical for r in answered], _shard_k(k, mode))
        dense = fusion.merge([r.dense for r in answered], _shard_k(k, mode))
        if mode == "lexical":
            return lexical[:k]
        if mode == "dense":
            return dense[:k]
        return fusion.rrf(lexical, dense, k, rrf_k=self.params.rrf_k, weights=self.params.weights)

    def _nobody_answered(self, timeout_ms: float) -> str:
        down = [s for s in range(self.params.shards) if not self.cluster.readable(s)]
        why = f"shards {down} have no live replica" if down else "the replicas were too slow"
        return f"no shard of index {self.cluster.name!r} answered within {timeout_ms:.0f} ms: {why}"

    def statistics(self) -> ServiceStatistics:
        health = self.embedder.health.state.value if self.embedder else "none"
        vectors = self.embedder.cache.statistics() if self.embedder else LRU(0).statistics()
        return ServiceStatistics(
            self.searches,
            self.degraded,
            self.partial,
            health,
            self.hedge.statistics(),
            vectors,
            self.results.statistics(),
            self.chooser.ties,
            self.scatter.failures,
            self.reembedder.statistics() if self.reembedder else None,
        )


def _shard_k(k: int, mode: str) -> int:
    """Each shard's list length: deeper for hybrid, so fusion sees what either list ranks high."""
    return min(2 * k, 1000) if mode == "hybrid" else k


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
