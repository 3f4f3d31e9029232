"""Re-embedding an index when its embedder's served version changes (a rolling update, `inferd update`).

The index records the embedder version of its vectors (data_dir's indexes/NAME/embedder.json). Once a
second the re-embedder compares it with the embedder's default version; when they differ it moves the
index, in the background:

1. record the target version, and open a second vector space on every shard (a `Reembed("begin")` log
   entry): from here on, new documents are embedded by both versions (their `next_vector`);
2. page through each shard's live documents that have no vector in the new space (`unvectored`, 128 a
   page), embed them by the new version at bulk priority (behind interactive traffic to the embedder)
   and log a `Revector` for each: it applies only while the document still has the content it was read
   with (a document changed meanwhile came with its own next_vector);
3. repeat the passes until one finds nothing left (a compaction renumbers slots under a cursor; writes
   that raced the start are caught by the next pass); then log `Reembed("promote")` on every shard, which
   makes the new space the one searched, and record the new version.

Until the promote, queries are embedded by the index's version (`Embedder.version`), so the query vector
always matches the vectors it is compared with. That needs the old version served: keep both served
while the re-embed runs (`version_policy = {latest = 2}`, then `inferd update` switches the default);
where the old version is gone (a plain rolling update retires it), hybrid searches are lexical
(degraded: ["dense"]) and dense ones 503 until the promote. A failed page (embedder down, no replica)
ends the attempt; the next second starts again, and the log keeps what was done (passes skip documents
already re-embedded). A restart resumes from the recorded target. If the served version changes again
meanwhile, the running re-embed is abandoned (`Reembed("abandon")`) and the next one starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from inferd.clock import Clock
from inferd.errors import ServingError, WorkerUnavailable
from inferd.kinds.search import wire
from inferd.kinds.search.embedder import Embedder, embed_text
from inferd.kinds.search.sequencer import ShardLog
from inferd.kinds.search.store import IndexStore
from inferd.kinds.search.types import Op, Reembed, Revector, content_digest

log = logging.getLogger("inferd.search")

PAGE_DOCUMENTS = 128
WATCH_INTERVAL_S = 1.0
CALL_TIMEOUT_S = 30.0
EMBED_TIMEOUT_S = 120.0

Ask = Callable[[int, str, bytes, int, float], Awaitable[bytes | None]]
"""Scatter.ask: one shard's answer to an op, from a replica that applied at least min_seq."""


class Shards(Protocol):
    name: str
    logs: list[ShardLog]
    follower: bool
    """This front end does not write the index now: no re-embed runs here meanwhile."""

    def appended(self, shard: int) -> None: ...


@dataclass(frozen=True, slots=True)
class ReembedStatistics:
    version: int | None
    """The embedder version of the vectors searched."""
    target: int | None
    """The version a running re-embed moves to (None: none running)."""
    reembedded: int
    """Documents re-embedded by the running (or last) re-embed."""
    completed: int


class Reembedder:
    def __init__(
        self,
        shards: Shards,
        embedder: Embedder,
        ask: Ask,
        store: IndexStore,
        clock: Clock,
        promoted: Callable[[], None],
    ) -> None:
        self.shards = shards
        self.embedder = embedder
        self.ask = ask
        self.store = store
        self.clock = clock
        self.embedder.version, self.embedder.target = store.embedder_versions(shards.name)
        self.reembedded = self.completed = 0
        self.promoted = promoted
        """Called after a promote (the service drops its cached results)."""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.shards.follower:  # another front end writes the index (or none does yet)
                continue
            try:
                await self.step()
            except ServingError as exc:
                log.warning("index %s: re-embed paused (%s); retrying", self.shards.name, exc.message)

    async def step(self) -> None:
        """Look at the served version once; when it moved, re-embed the whole index to it."""
        served = self.embedder.served_version()
        if served is None:
            return
        if self.embedder.version is None:  # a new index: its vectors are the served version's
            self._save(served, None)
            return
        if served == self.embedder.version:
            if self.embedder.target is not None:  # rolled back before the re-embed was done
                await self._abandon()
            return
        if self.embedder.target not in (None, served):
            await self._abandon()
        await self._reembed(served)

    async def _reembed(self, target: int) -> None:
        if self.embedder.target is None:
            log.info(
                "index %s: embedder %s v%s -> v%d: re-embedding in the background",
                self.shards.name,
                self.embedder.model,
                self.embedder.version,
                target,
            )
            self.reembedded = 0
        self._save(self.embedder.version, target)
        await self._append_all(Reembed(action="begin", version=target))
        while sum([await self._pass(shard, target) for shard in range(len(self.shards.logs))]) > 0:
            if self.embedder.served_version() != target:
                return  # moved again: the next step abandons this one
        await self._append_all(Reembed(action="promote", version=target))
        self._save(target, None)
        self.embedder.promote(target)
        self.completed += 1
        self.promoted()
        log.info("index %s: re-embedded by %s v%d", self.shards.name, self.embedder.model, target)

    async def _pass(self, shard: int, target: int) -> int:
        """Re-embed the shard's documents that have no vector by `target` yet; how many there were."""
        cursor, moved = 0, 0
        while True:
            seq = self.shards.logs[shard].durable_seq
            body = wire.encode((cursor, PAGE_DOCUMENTS))
            answer = await self.ask(shard, "unvectored", body, seq, self.clock.now() + CALL_TIMEOUT_S)
            if answer is None:
                raise WorkerUnavailable(f"no replica of shard {shard} answered")
            page = wire.page(answer)
            if page.docs:
                texts = [embed_text(d) for d in page.docs]
                vectors = await self.embedder.documents(texts, self.clock.now() + EMBED_TIMEOUT_S, target)
                ops: list[Op] = [
                    Revector(id=d.id, digest=content_digest(d), vector=v)
                    for d, v in zip(page.docs, vectors, strict=True)
                ]
                await self._append(shard, ops)
                moved += len(ops)
                self.reembedded += len(ops)
            if page.done:
                return moved
            cursor = page.cursor

    async def _abandon(self) -> None:
        log.info("index %s: re-embed to v%s abandoned", self.shards.name, self.embedder.target)
        await self._append_all(Reembed(action="abandon", version=self.embedder.target or 0))
        self.embedder.target = None
        self._save(self.embedder.version, None)

    async def _append_all(self, op: Op) -> None:
        for shard in range(len(self.shards.logs)):
            await self._append(shard, [op])

    async def _append(self, shard: int, ops: list[Op]) -> None:
        await self.shards.logs[shard].append(ops)
        self.shards.appended(shard)

    def _save(self, version: int | None, target: int | None) -> None:
        self.store.save_embedder_versions(self.shards.name, version, target)
        self.embedder.version, self.embedder.target = version, target

    def statistics(self) -> ReembedStatistics:
        return ReembedStatistics(self.embedder.version, self.embedder.target, self.reembedded, self.completed)
