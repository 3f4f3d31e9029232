"""Re-embedding when the embedder's served version changes: every document gets the new version's vector
in the background, queries keep the index's version until the promote, a document changed meanwhile keeps
its own new vector, and a snapshot taken midway keeps the half-built space."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from inferd.clock import FakeClock
from inferd.errors import ModelError, NotFound
from inferd.kinds.batch.service import BatchService
from inferd.kinds.search import wire
from inferd.kinds.search.embedder import Embedder
from inferd.kinds.search.reembed import Reembedder
from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.store import IndexStore
from inferd.kinds.search.types import (
    Document,
    IndexSettings,
    LogEntry,
    Op,
    Reembed,
    Revector,
    ShardQuery,
    Upsert,
    content_digest,
)
from tests.fakes.hash_embedder import embed

DIM = 8
SETTINGS = IndexSettings(shards=2, dim=DIM)


def vector(text: str, version: int) -> bytes:
    """Version `version` of a fake embedder: a different vector for every (version, text)."""
    v = embed(f"v{version}:{text}".encode())
    return (v / np.linalg.norm(v)).astype("<f4").tobytes()


class FakeVersion:
    """One served version of the embedder model (a batch runtime, asked through its real BatchService);
    `gate` holds its answers back."""

    kind = "batch"

    def __init__(self, clock: FakeClock, version: int, gated: bool = False) -> None:
        self.clock = clock
        self.service = BatchService(self)
        self.version = version
        self.texts: list[str] = []
        self.gate = asyncio.Event()
        self.asked = asyncio.Event()
        if not gated:
            self.gate.set()

    def enqueue(self, payloads: list[bytes], deadline: Any, priority: int, tenant: Any) -> list[Any]:
        self.asked.set()
        return [SimpleNamespace(reply=asyncio.ensure_future(self._answer(t.decode()))) for t in payloads]

    async def _answer(self, text: str) -> Any:
        await self.gate.wait()
        self.texts.append(text)
        v = np.frombuffer(vector(text, self.version), dtype="<f4")
        return SimpleNamespace(outputs={"EMBEDDING": v})

    def withdraw(self, items: list[Any]) -> None:
        raise AssertionError("no embedding may time out here")

    def expire(self, items: list[Any]) -> None:
        raise AssertionError("no embedding may time out here")


class FakeRegistry:
    def __init__(self, clock: FakeClock) -> None:
        self.served: dict[int, FakeVersion] = {1: FakeVersion(clock, 1)}
        self.default = 1

    def get(self, name: str, version: int | None = None) -> FakeVersion:
        v = self.default if version is None else version
        if v not in self.served:
            raise NotFound(f"model {name!r} version {v} is not served")
        return self.served[v]


class FakeLog:
    """A shard's log that applies each append to the shard at once (one replica, always fresh)."""

    def __init__(self, shard: ShardIndex) -> None:
        self.shard = shard
        self.durable_seq = 0

    async def append(self, ops: list[Op]) -> int:
        self.durable_seq += 1
        self.shard.apply(LogEntry(seq=self.durable_seq, ops=ops))
        return self.durable_seq


class FakeShards:
    name = "idx"
    follower = False

    def __init__(self) -> None:
        self.indexes = [ShardIndex(SETTINGS), ShardIndex(SETTINGS)]
        self.logs = [FakeLog(s) for s in self.indexes]

    def appended(self, shard: int) -> None:
        pass

    async def ask(self, shard: int, op: str, body: bytes, min_seq: int, deadline: float) -> bytes:
        assert op == "unvectored" and self.logs[shard].durable_seq >= min_seq
        return wire.encode(self.indexes[shard].unvectored(*wire.pair(body)))

    def top(self, text: str, version: int) -> tuple[str, float]:
        query = ShardQuery(vector=vector(text, version), k=1, mode="dense")
        hits = [h for s in self.indexes for h in s.search(query).dense]
        best = max(hits, key=lambda h: h.score)
        return best.id, best.score


def docs(n: int) -> list[Document]:
    return [Document(id=f"d{i}", title=f"title {i}", text=f"text number {i}") for i in range(n)]


async def test_a_new_served_version_reembeds_every_document_while_queries_keep_the_index_version(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    registry, shards = FakeRegistry(clock), FakeShards()
    embedder = Embedder("emb", DIM, registry.get, clock)
    promoted: list[int] = []
    store = IndexStore(tmp_path)
    reembedder = Reembedder(shards, embedder, shards.ask, store, clock, lambda: promoted.append(1))
    corpus = docs(300)  # 150 a shard: two pages each
    for i, doc in enumerate(corpus):
        await shards.logs[i % 2].append([Upsert(doc=doc, vector=vector(f"{doc.title}\n{doc.text}", 1))])
    await reembedder.step()
    assert store.embedder_versions("idx") == (1, None)  # a new index records the served version

    v2 = registry.served[2] = FakeVersion(clock, 2, gated=True)
    registry.default = 2  # a rolling update, with the old version still served beside it
    async with asyncio.TaskGroup() as tg:
        step = tg.create_task(reembedder.step())
        await v2.asked.wait()  # the re-embed is under way: its first page waits on version 2
        assert store.embedder_versions("idx") == (1, 2)
        assert await embedder.query("zebra", clock.now() + 5) == vector("zebra", 1)
        assert shards.top("title 4\ntext number 4", 1) == ("d4", np.float32(1.0))  # still version 1's
        changed = Document(id="d2", title="title 2", text="changed text")  # read by the first page
        await shards.logs[0].append(
            [Upsert(doc=changed, vector=vector("x", 1), next_vector=vector("title 2\nchanged text", 2))]
        )
        v2.gate.set()
        await step
    assert promoted == [1] and reembedder.statistics().completed == 1
    assert store.embedder_versions("idx") == (2, None)
    assert [s.dense_version for s in shards.indexes] == [2, 2]
    for doc in corpus[:40]:
        found, score = shards.top(
            f"{doc.title}\n{doc.text}" if doc.id != "d2" else "title 2\nchanged text", 2
        )
        assert found == doc.id and abs(score - 1.0) < 1e-5
    assert "zebra" not in v2.texts
    assert await embedder.query("zebra", clock.now() + 5) == vector("zebra", 2)  # queries move too


async def test_a_rollback_before_the_end_abandons_the_reembed(tmp_path: Path) -> None:
    clock = FakeClock()
    registry, shards = FakeRegistry(clock), FakeShards()
    embedder = Embedder("emb", DIM, registry.get, clock)
    store = IndexStore(tmp_path)
    store.save_embedder_versions("idx", 1, 2)  # a re-embed to 2 was running at the last stop
    reembedder = Reembedder(shards, embedder, shards.ask, store, clock, lambda: None)
    await reembedder.step()  # version 1 is the default again
    assert store.embedder_versions("idx") == (1, None) and embedder.target is None
    assert all(log.durable_seq == 1 for log in shards.logs)  # one "abandon" entry a shard


def test_a_snapshot_midway_keeps_the_half_built_space_and_stale_revectors_are_ignored(tmp_path: Path) -> None:
    shard = ShardIndex(SETTINGS)
    a, b = Document(id="a", text="alpha"), Document(id="b", text="beta")
    shard.apply(
        LogEntry(
            seq=1, ops=[Upsert(doc=a, vector=vector("alpha", 1)), Upsert(doc=b, vector=vector("beta", 1))]
        )
    )
    shard.apply(LogEntry(seq=2, ops=[Reembed(action="begin", version=2)]))
    shard.apply(LogEntry(seq=3, ops=[Revector(id="a", digest=content_digest(a), vector=vector("alpha", 2))]))
    stale = Revector(id="b", digest=content_digest(Document(id="b", text="old beta")), vector=vector("x", 2))
    shard.apply(LogEntry(seq=4, ops=[stale]))
    assert [d.id for d in shard.unvectored(0, 10).docs] == ["b"]  # the stale one changed nothing
    shard.save(tmp_path / "snap")
    loaded = ShardIndex.load(tmp_path / "snap", SETTINGS)
    assert [d.id for d in loaded.unvectored(0, 10).docs] == ["b"]
    loaded.apply(LogEntry(seq=5, ops=[Revector(id="b", digest=content_digest(b), vector=vector("beta", 2))]))
    loaded.apply(LogEntry(seq=6, ops=[Reembed(action="promote", version=2)]))
    hit = loaded.search(ShardQuery(vector=vector("beta", 2), k=1, mode="dense")).dense[0]
    assert hit.id == "b" and abs(hit.score - 1.0) < 1e-5 and loaded.dense_version == 2



async def test_an_embedder_that_the_oip_routes_do_not_serve_is_refused_by_its_kinds_route_family() -> None:
    clock = FakeClock()
    registry = FakeRegistry(clock)
    text_routes = Embedder("emb", DIM, registry.get, clock, api_of=lambda rt: "text")  # e.g. an LLM
    with pytest.raises(ModelError, match="'emb' is a batch model, not a batch embedding model"):
        await text_routes.query("zebra", clock.now() + 5)
    assert registry.served[1].texts == []  # refused before anything was queued
    oip_routes = Embedder("emb", DIM, registry.get, clock, api_of=lambda rt: "oip")
    assert await oip_routes.query("zebra", clock.now() + 5) == vector("zebra", 1)
