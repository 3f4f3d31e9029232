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

import msgspec
import numpy as np

from inferd.errors import BadRequest
from inferd.search import snapshot
from inferd.search.analyzer import document_text, tokenize
from inferd.search.dense import DenseIndex
from inferd.search.filters import FieldColumns
from inferd.search.lexical import LexicalIndex
from inferd.search.types import (
    CorruptSnapshot,
    Delete,
    Document,
    IndexSettings,
    LogEntry,
    SeqGap,
    ShardHit,
    ShardQuery,
    ShardResult,
    Upsert,
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
        self._dense = DenseIndex(
            settings.dim,
            m=settings.hnsw_m,
            ef_construction=settings.ef_construction,
            ef_search=settings.ef_search,
            fresh_limit=dense_fresh_limit,
        )
        self._columns = FieldColumns(settings.fields)
        self._docs: list[Document | None] = []  # slot -> document (None once tombstoned)
        self._slot_of: dict[str, int] = {}

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
        vectors = [self._vector(op.vector) if isinstance(op, Upsert) else None for op in entry.ops]
        for op, vector in zip(entry.ops, vectors, strict=True):
            if isinstance(op, Upsert):
                self._upsert(op.doc, vector)
            elif isinstance(op, Delete):
                self._delete(op.id)
        self.applied_seq = entry.seq
        dead = len(self._docs) - len(self._slot_of)
        if dead >= self.compact_min_dead and dead > self.compact_fraction * len(self._docs):
            self.compact()

    def _vector(self, raw: bytes | None) -> np.ndarray | None:
        if raw is None:
            return None
        if len(raw) != self.settings.dim * 4:
            raise BadRequest(f"vector has {len(raw)} bytes; this index wants {self.settings.dim} float32s")
        return np.frombuffer(raw, dtype="<f4")

    def _upsert(self, doc: Document, vector: np.ndarray | None, merge: bool = True) -> None:
        self._delete(doc.id)
        tokens = tokenize(document_text(doc.title, doc.text), self.settings.stopwords)
        slot = self._lexical.add(tokens, merge=merge)
        self._docs.append(doc)
        self._columns.add(slot, doc.fields)
        if vector is not None:
            self._dense.add(slot, vector)
        self._slot_of[doc.id] = slot

    def _delete(self, doc_id: str) -> None:
        slot = self._slot_of.pop(doc_id, None)
        if slot is None:
            return
        self._lexical.remove(slot)
        self._dense.remove(slot)
        self._docs[slot] = None

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
        dense = self._dense.state()
        files = {
            "docs.msgpack": _docs_encoder.encode(self._docs),
            "graph.faiss": dense["graph"].tobytes(),
            "graph_slot.npy": _npy(dense["graph_slot"]),
            "graph_live.npy": _npy(dense["graph_live"]),
        }
        meta = {"format": SNAPSHOT_FORMAT, "dim": self.settings.dim, "documents": self.documents}
        snapshot.write(directory, self.applied_seq, files, meta)

    @classmethod
    def load(cls, directory: Path, settings: IndexSettings, **options: float) -> ShardIndex:
        """The shard a snapshot holds; the caller then replays its log from applied_seq + 1."""
        applied_seq, files, meta = snapshot.read(directory)
        if meta.get("format") != SNAPSHOT_FORMAT or meta.get("dim") != settings.dim:
            raise CorruptSnapshot(
                f"snapshot in {directory} has format {meta.get('format')} and dim {meta.get('dim')}; "
                f"expected format {SNAPSHOT_FORMAT} and dim {settings.dim}"
            )
        shard = cls(settings, **options)  # type: ignore[arg-type]
        docs = _docs_decoder.decode(files["docs.msgpack"])
        for doc in docs:
            shard._restore(doc)
        shard._lexical.merge()
        shard._dense.load_state(
            {
                "graph": np.frombuffer(files["graph.faiss"], dtype=np.uint8),
                "graph_slot": _from_npy(files["graph_slot.npy"]),
                "graph_live": _from_npy(files["graph_live.npy"]),
            }
        )
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


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def _from_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)
