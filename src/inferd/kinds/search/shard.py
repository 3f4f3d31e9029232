"""One shard replica's index: stored documents, BM25 (lexical.py), HNSW (dense.py) and typed fields
(filters.py), changed only by applying the shard's log entries in seq order.

Every document version lives in a slot (0, 1, 2 ...): an upsert takes a new slot and tombstones the slot
of the version it replaces, a delete tombstones. After `apply` returns, `search` sees the change: BM25
statistics change at once, new postings and vectors go to fresh segments that are searched together with
the base ones. When more than `compact_fraction` of the slots are tombstones (and at least
`compact_min_dead`), the shard compacts: slots are renumbered, BM25 is rebuilt from the live documents and
the HNSW graph keeps its vectors (only its slot map changes). Not thread-safe: the caller serialises
apply, search, save and compact (a replica does them on one thread or under one lock).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from inferd.errors import BadRequest
from inferd.kinds.search import snapshot
from inferd.kinds.search.analyzer import document_text, tokenize
from inferd.kinds.search.dense import DenseIndex
from inferd.kinds.search.filters import FieldColumns
from inferd.kinds.search.lexical import LexicalIndex
from inferd.kinds.search.types import (
    CorruptSnapshot,
    Delete,
    Document,
    IndexSettings,
    LogEntry,
    Op,
    Reembed,
    Revector,
    SeqGap,
    ShardHit,
    ShardQuery,
    ShardResult,
    UnvectoredPage,
    Upsert,
    content_digest,
)

SNAPSHOT_FORMAT = 1
_docs_encoder = msgspec.msgpack.Encoder()
_docs_decoder = msgspec.msgpack.Decoder(list[Document | None])


class ShardIndex:
    def __init__(
        self,
        settings: IndexSettings,
        *,
        lexical_fresh_limit: int = 4096,
        dense_fresh_limit: int = 2048,
        compact_fraction: float = 0.5,
        compact_min_dead: int = 1024,
    ) -> None:
        self.settings = settings
        self.applied_seq = 0
        self.compact_fraction = compact_fraction
        self.compact_min_dead = compact_min_dead
        self._lexical_fresh_limit = lexical_fresh_limit
        self._lexical = LexicalIndex(settings.k1, settings.b, fresh_limit=lexical_fresh_limit)
        self._dense_fresh_limit = dense_fresh_limit
        self._dense = self._new_dense()
        self.dense_version = 0
        """The embedder version of the searched vectors (set by a re-embed's promote; 0: not recorded)."""
        self._next: DenseIndex | None = None  # the vectors of a running re-embed
        self.next_version = 0
        self._columns = FieldColumns(settings.fields)
        self._docs: list[Document | None] = []  # slot -> document (None once tombstoned)
        self._slot_of: dict[str, int] = {}

    def _new_dense(self) -> DenseIndex:
        return DenseIndex(
            self.settings.dim,
            m=self.settings.hnsw_m,
            ef_construction=self.settings.ef_construction,
            ef_search=self.settings.ef_search,
            fresh_limit=self._dense_fresh_limit,
        )

    @property
    def documents(self) -> int:
        return len(self._slot_of)

    def get(self, doc_id: str) -> Document | None:
        slot = self._slot_of.get(doc_id)
        return None if slot is None else self._docs[slot]

    # --- writes -------------------------------------------------------------------------------------

    def apply(self, entry: LogEntry) -> None:
        """Apply one log entry. An entry already applied (seq <= applied_seq) is ignored, so replay is
        safe; any other seq than applied_seq + 1 raises SeqGap. The entry is checked whole before anything
        changes, so a bad one (a vector of the wrong size) changes nothing."""
        if entry.seq <= self.applied_seq:
            return
        if entry.seq != self.applied_seq + 1:
            raise SeqGap(
                f"shard at seq {self.applied_seq} got entry {entry.seq}; entries in between are missing",
                applied_seq=self.applied_seq,
                got=entry.seq,
            )
        vectors = [self._op_vectors(op) for op in entry.ops]
        for op, (vector, next_vector) in zip(entry.ops, vectors, strict=True):
            if isinstance(op, Upsert):
                self._upsert(op.doc, vector, next_vector)
            elif isinstance(op, Delete):
                self._delete(op.id)
            elif isinstance(op, Revector):
                self._revector(op.id, op.digest, next_vector)
            elif isinstance(op, Reembed):
                self._reembed(op)
        self.applied_seq = entry.seq
        dead = len(self._docs) - len(self._slot_of)
        if dead >= self.compact_min_dead and dead > self.compact_fraction * len(self._docs):
            self.compact()

    def _op_vectors(self, op: Op) -> tuple[np.ndarray | None, np.ndarray | None]:
        """An op's vector and next-space vector, checked."""
        if isinstance(op, Upsert):
            return self._vector(op.vector), self._vector(op.next_vector)
        if isinstance(op, Revector):
            return None, self._vector(op.vector)
        return None, None

    def _vector(self, raw: bytes | None) -> np.ndarray | None:
        if raw is None:
            return None
        if len(raw) != self.settings.dim * 4:
            raise BadRequest(f"vector has {len(raw)} bytes; this index wants {self.settings.dim} float32s")
        return np.frombuffer(raw, dtype="<f4")

    def _upsert(
        self, doc: Document, vector: np.ndarray | None, next_vector: np.ndarray | None = None
    ) -> None:
        self._delete(doc.id)
        tokens = tokenize(document_text(doc.title, doc.text), self.settings.stopwords)
        slot = self._lexical.add(tokens)
        self._docs.append(doc)
        self._columns.add(slot, doc.fields)
        if vector is not None:
            self._dense.add(slot, vector)
        if next_vector is not None and self._next is not None:
            self._next.add(slot, next_vector)
        self._slot_of[doc.id] = slot

    def _delete(self, doc_id: str) -> None:
        slot = self._slot_of.pop(doc_id, None)
        if slot is None:
            return
        self._lexical.remove(slot)
        self._dense.remove(slot)
        if self._next is not None:
            self._next.remove(slot)
        self._docs[slot] = None

    # --- re-embedding (the embedder's served version changed) ---------------------------------------

    def _revector(self, doc_id: str, digest: bytes, vector: np.ndarray | None) -> None:
        slot = self._slot_of.get(doc_id)
        doc = None if slot is None else self._docs[slot]
        if self._next is None or slot is None or doc is None or content_digest(doc) != digest:
            return  # no re-embed running, or the document was deleted or changed since it was read
        self._next.remove(slot)
        if vector is not None:
            self._next.add(slot, vector)

    def _reembed(self, op: Reembed) -> None:
        if op.action == "begin" and (self._next is None or self.next_version != op.version):
            self._next, self.next_version = self._new_dense(), op.version
        elif op.action == "promote" and self._next is not None and self.next_version == op.version:
            self._dense, self.dense_version = self._next, op.version
            self._next, self.next_version = None, 0
        elif op.action == "abandon":
            self._next, self.next_version = None, 0

    def unvectored(self, cursor: int, limit: int) -> UnvectoredPage:
        """Live documents from slot `cursor` on that have no vector in the re-embed's space yet."""
        docs: list[Document] = []
        slot = cursor
        while slot < len(self._docs) and len(docs) < limit and self._next is not None:
            doc = self._docs[slot]
            if doc is not None and not self._next.has(slot):
                docs.append(doc)
            slot += 1
        done = self._next is None or slot >= len(self._docs)
        return UnvectoredPage(docs=docs, cursor=slot, done=done, dense_version=self.dense_version)

    def compact(self) -> None:
        """Drop tombstoned slots: renumber the live ones in order and rebuild BM25 from them."""
        keep = np.asarray(sorted(self._slot_of.values()), dtype=np.int64)
        new_slot = np.full(len(self._docs), -1, dtype=np.int64)
        new_slot[keep] = np.arange(len(keep))
        docs = [self._docs[s] for s in keep.tolist()]
        self._lexical = LexicalIndex(self.settings.k1, self.settings.b, fresh_limit=self._lexical_fresh_limit)
        for doc in docs:
            assert doc is not None  # keep holds live slots only
            self._lexical.add(
                tokenize(document_text(doc.title, doc.text), self.settings.stopwords), merge=False
            )
        self._lexical.merge()
        self._columns.renumber(keep)
        self._dense.renumber(new_slot)
        if self._next is not None:
            self._next.renumber(new_slot)
        self._docs = docs  # type: ignore[assignment]
        self._slot_of = {doc.id: i for i, doc in enumerate(docs)}  # type: ignore[union-attr]

    # --- reads --------------------------------------------------------------------------------------

    def search(self, query: ShardQuery) -> ShardResult:
        allowed = self._columns.mask(query.filter) if query.filter and query.filter.conditions else None
        lexical: list[ShardHit] = []
        dense: list[ShardHit] = []
        if query.mode in ("hybrid", "lexical") and query.text:
            tokens = tokenize(query.text, self.settings.stopwords)
            lexical = self._hits(*self._lexical.search(tokens, query.k, allowed))
        if query.mode in ("hybrid", "dense") and query.vector is not None:
            vector = self._vector(query.vector)
            dense = self._hits(*self._dense.search(vector, query.k, allowed))
        return ShardResult(lexical=lexical, dense=dense, applied_seq=self.applied_seq)

    def _hits(self, slots: np.ndarray, scores: np.ndarray) -> list[ShardHit]:
        hits = []
        for slot, score in zip(slots.tolist(), scores.tolist(), strict=True):
            doc = self._docs[slot]
            if doc is not None:
                hits.append(ShardHit(id=doc.id, score=score, title=doc.title))
        return hits

    def statistics(self) -> dict[str, object]:
        return {
            "applied_seq": self.applied_seq,
            "documents": self.documents,
            "slots": len(self._docs),
            "lexical": self._lexical.statistics(),
            "dense": self._dense.statistics(),
        }

    # --- snapshots ----------------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write a snapshot of this shard (atomic: snapshot.py) holding applied_seq."""
        snapshot.write(directory, self.applied_seq, *self.snapshot_parts())

    def packed(self) -> bytes:
        """A snapshot of this shard as one blob, for the wire (snapshot.pack)."""
        return snapshot.pack(self.applied_seq, *self.snapshot_parts())

    def snapshot_parts(self) -> tuple[dict[str, bytes], dict[str, Any]]:
        """(files, metadata) of a snapshot of this shard."""
        files = {"docs.msgpack": _docs_encoder.encode(self._docs), **_dense_files(self._dense, "")}
        if self._next is not None:
            files.update(_dense_files(self._next, "next_"))
        meta = {
            "format": SNAPSHOT_FORMAT,
            "dim": self.settings.dim,
            "documents": self.documents,
            "dense_version": self.dense_version,
            "next_version": self.next_version if self._next is not None else None,
        }
        return files, meta

    @classmethod
    def load(cls, directory: Path, settings: IndexSettings, **options: float) -> ShardIndex:
        """The shard a snapshot holds; the caller then replays its log from applied_seq + 1."""
        return cls.from_parts(*snapshot.read(directory), settings, f"snapshot in {directory}", **options)

    @classmethod
    def unpacked(cls, data: bytes, settings: IndexSettings) -> ShardIndex:
        """The shard a packed snapshot (from the wire) holds."""
        return cls.from_parts(*snapshot.unpack(data), settings, "the snapshot received")

    @classmethod
    def from_parts(
        cls,
        applied_seq: int,
        files: dict[str, bytes],
        meta: dict[str, Any],
        settings: IndexSettings,
        where: str,
        **options: float,
    ) -> ShardIndex:
        if meta.get("format") != SNAPSHOT_FORMAT or meta.get("dim") != settings.dim:
            raise CorruptSnapshot(
                f"{where} has format {meta.get('format')} and dim {meta.get('dim')}; "
                f"expected format {SNAPSHOT_FORMAT} and dim {settings.dim}"
            )
        shard = cls(settings, **options)  # type: ignore[arg-type]
        docs = _docs_decoder.decode(files["docs.msgpack"])
        for doc in docs:
            shard._restore(doc)
        shard._lexical.merge()
        shard._dense.load_state(_dense_state(files, ""))
        shard.dense_version = int(meta.get("dense_version") or 0)
        if meta.get("next_version") is not None:
            shard._next, shard.next_version = shard._new_dense(), int(meta["next_version"])
            shard._next.load_state(_dense_state(files, "next_"))
        shard.applied_seq = applied_seq
        return shard

    def _restore(self, doc: Document | None) -> None:
        """Put a snapshot's slot back (lexical and fields only; the graph comes whole)."""
        if doc is None:
            slot = self._lexical.add([], merge=False)
            self._lexical.remove(slot)
            self._columns.add(slot, {})
            self._docs.append(None)
            return
        tokens = tokenize(document_text(doc.title, doc.text), self.settings.stopwords)
        slot = self._lexical.add(tokens, merge=False)
        self._columns.add(slot, doc.fields)
        self._docs.append(doc)
        self._slot_of[doc.id] = slot


def _dense_files(dense: DenseIndex, prefix: str) -> dict[str, bytes]:
    state = dense.state()
    return {
        f"{prefix}graph.faiss": state["graph"].tobytes(),
        f"{prefix}graph_slot.npy": _npy(state["graph_slot"]),
        f"{prefix}graph_live.npy": _npy(state["graph_live"]),
    }


def _dense_state(files: dict[str, bytes], prefix: str) -> dict[str, np.ndarray]:
    return {
        "graph": np.frombuffer(files[f"{prefix}graph.faiss"], dtype=np.uint8),
        "graph_slot": _from_npy(files[f"{prefix}graph_slot.npy"]),
        "graph_live": _from_npy(files[f"{prefix}graph_live.npy"]),
    }


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def _from_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)
