"""BM25 over a changing set of documents, with scores equal to a from-scratch BM25 over the live ones.

Scoring is bm25s's `lucene` method (Robertson's tf component, Lucene's idf), computed lazily at query time:

    score(d, q) = sum over query tokens t (repeats count) of
                  idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * len(d) / avgdl))
    idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

N, df and avgdl are kept for the live documents only, and updated on every add and remove, so a score never
depends on what was deleted or on when segments merged. (bm25s itself precomputes every score at index time
from these statistics, which is why it cannot take one document at a time: docs/search.md.)

Documents live in slots (ints, appended in order). Postings sit in two segments: a base segment of flat
arrays sorted by term (CSR-like), and a fresh segment of per-term growable buffers (`array.array`, read as numpy
views without a copy) that takes new documents. When the fresh segment holds `fresh_limit` documents and
at least `merge_ratio` times as many as the base, `merge()` rebuilds the base from the live slots; the
ratio keeps the total merge work of n additions O(n / merge_ratio) postings. Removed
slots keep their postings until then and are masked out at query time (a tombstone is one bool).
"""

from __future__ import annotations

import math
from array import array
from collections import Counter

import numpy as np


def grown(array: np.ndarray, size: int) -> np.ndarray:
    """`array` with room for at least `size` items (capacity doubles; new room is zero)."""
    if size <= len(array):
        return array
    bigger = np.zeros(max(size, 2 * len(array), 64), dtype=array.dtype)
    bigger[: len(array)] = array
    return bigger


class LexicalIndex:
    """BM25 postings over slots 0..slots-1; not thread-safe (the shard serialises access)."""

    def __init__(
        self, k1: float = 0.9, b: float = 0.4, fresh_limit: int = 4096, merge_ratio: float = 0.25
    ) -> None:
        self.k1 = k1
        self.b = b
        self.fresh_limit = fresh_limit
        self.merge_ratio = merge_ratio
        self.vocab: dict[str, int] = {}
        self.df: list[int] = []
        self.slots = 0
        self.live_count = 0
        self.total_length = 0
        self._live = np.zeros(0, dtype=bool)
        self._length = np.zeros(0, dtype=np.float32)
        self._terms: list[np.ndarray | None] = []  # per slot: unique term ids (None once removed)
        self._tfs: list[np.ndarray | None] = []  # per slot: their counts
        self._base_ptr = np.zeros(1, dtype=np.int64)
        self._base_slot = np.zeros(0, dtype=np.int32)
        self._base_tf = np.zeros(0, dtype=np.float32)
        self._base_len = np.zeros(0, dtype=np.float32)
        self._fresh: dict[int, tuple[array, array, array]] = {}  # term -> (slots, tfs, lengths)
        self._fresh_docs = 0
        self._base_docs = 0

    @property
    def live_mask(self) -> np.ndarray:
        """A bool per slot: not removed (a view; do not write to it)."""
        return self._live[: self.slots]

    def add(self, tokens: list[str], merge: bool = True) -> int:
        """Index a document's tokens in the next slot; returns the slot. `merge=False` leaves merging to the
        caller (a bulk load merges once at the end)."""
        slot = self.slots
        counts = Counter(self._term_id(t) for t in tokens)
        terms = np.fromiter(counts.keys(), dtype=np.int32, count=len(counts))
        tfs = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        length = len(tokens)
        self._live = grown(self._live, slot + 1)
        self._length = grown(self._length, slot + 1)
        self._live[slot] = True
        self._length[slot] = length
        self._terms.append(terms)
        self._tfs.append(tfs)
        self.slots += 1
        self.live_count += 1
        self.total_length += length
        for term, tf in counts.items():
            self.df[term] += 1
            postings = self._fresh.get(term)
            if postings is None:
                postings = self._fresh[term] = (array("i"), array("f"), array("f"))
            postings[0].append(slot)
            postings[1].append(tf)
            postings[2].append(length)
        self._fresh_docs += 1
        if merge and self._fresh_docs >= max(self.fresh_limit, self.merge_ratio * self._base_docs):
            self.merge()
        return slot

    def remove(self, slot: int) -> None:
        """Tombstone a slot: it stops counting in N, df and avgdl at once, its postings go at the next merge."""
        terms = self._terms[slot]
        if terms is None:
            return
        self._live[slot] = False
        for term in terms.tolist():
            self.df[term] -= 1
        self.live_count -= 1
        self.total_length -= int(self._length[slot])
        self._terms[slot] = None
        self._tfs[slot] = None

    def merge(self) -> None:
        """Rebuild the base segment from every live slot; the fresh segment becomes empty."""
        live = [s for s in range(self.slots) if self._terms[s] is not None]
        if live:
            terms = np.concatenate([self._terms[s] for s in live])  # type: ignore[misc]
            tfs = np.concatenate([self._tfs[s] for s in live])  # type: ignore[misc]
            sizes = np.fromiter((len(self._terms[s]) for s in live), dtype=np.int64, count=len(live))  # type: ignore[arg-type]
            slots = np.repeat(np.asarray(live, dtype=np.int32), sizes)
        else:
            terms = np.zeros(0, dtype=np.int32)
            tfs = np.zeros(0, dtype=np.float32)
            slots = np.zeros(0, dtype=np.int32)
        order = np.argsort(terms, kind="stable")
        self._base_slot = slots[order]
        self._base_tf = tfs[order]
        self._base_len = self._length[self._base_slot]
        self._base_ptr = np.zeros(len(self.vocab) + 1, dtype=np.int64)
        np.cumsum(np.bincount(terms, minlength=len(self.vocab)), out=self._base_ptr[1:])
        self._fresh = {}
        self._fresh_docs = 0
        self._base_docs = len(live)

    def idf(self, term: int) -> float:
        df = self.df[term]
        return math.log(1.0 + (self.live_count - df + 0.5) / (df + 0.5))

    def search(
        self, tokens: list[str], k: int, allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(slots, scores) of the top k live documents with a positive score, best first, ties to the lower
        slot; `allowed` (a bool per slot) restricts them further."""
        weights = Counter(self.vocab[t] for t in tokens if t in self.vocab)
        weights = Counter({t: w for t, w in weights.items() if self.df[t] > 0})
        if not weights or self.live_count == 0 or k <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        avgdl = self.total_length / self.live_count
        c1 = self.k1 * (1.0 - self.b)
        c2 = self.k1 * self.b / avgdl if avgdl > 0 else 0.0
        parts_slot: list[np.ndarray] = []
        parts_score: list[np.ndarray] = []
        for term, repeats in weights.items():
            slot, tf, length = self._postings(term)
            parts_slot.append(slot)
            parts_score.append((repeats * self.idf(term)) * tf / (tf + c1 + c2 * length))
        slots = np.concatenate(parts_slot)
        scores = np.concatenate(parts_score).astype(np.float64)
        return self._top(slots, scores, k, allowed)

    def _top(
        self, slots: np.ndarray, scores: np.ndarray, k: int, allowed: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        keep = self._live[slots]
        if allowed is not None:
            keep &= allowed[slots]
        slots, scores = slots[keep], scores[keep]
        if len(slots) * 8 < self.slots:  # few postings: group them by sorting
            uniq, inverse = np.unique(slots, return_inverse=True)
            sums = np.bincount(inverse, weights=scores, minlength=len(uniq))
        else:  # many: one dense accumulator beats a sort
            dense = np.bincount(slots, weights=scores, minlength=self.slots)
            uniq = np.flatnonzero(dense > 0)
            sums = dense[uniq]
        positive = sums > 0
        uniq, sums = uniq[positive], sums[positive]
        if len(uniq) > k:
            cut = np.argpartition(-sums, k - 1)[:k]
            threshold = sums[cut].min()
            tied = np.flatnonzero(sums >= threshold)  # everything tied with the k-th competes on slot
            uniq, sums = uniq[tied], sums[tied]
        order = np.lexsort((uniq, -sums))[:k]
        return uniq[order].astype(np.int64), sums[order]

    def _postings(self, term: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, tfs, lengths) of a term in both segments; removed slots included."""
        if term + 1 < len(self._base_ptr):
            lo, hi = self._base_ptr[term], self._base_ptr[term + 1]
            base = (self._base_slot[lo:hi], self._base_tf[lo:hi], self._base_len[lo:hi])
        else:
            base = (self._base_slot[:0], self._base_tf[:0], self._base_len[:0])
        fresh = self._fresh.get(term)
        if not fresh:
            return base
        return (
            np.concatenate([base[0], np.frombuffer(fresh[0], dtype=np.int32)]),
            np.concatenate([base[1], np.frombuffer(fresh[1], dtype=np.float32)]),
            np.concatenate([base[2], np.frombuffer(fresh[2], dtype=np.float32)]),
        )

    def _term_id(self, token: str) -> int:
        term = self.vocab.get(token)
        if term is None:
            term = self.vocab[token] = len(self.vocab)
            self.df.append(0)
        return term

    def statistics(self) -> dict[str, int]:
        return {
            "slots": self.slots,
            "live": self.live_count,
            "terms": len(self.vocab),
            "base_postings": len(self._base_slot),
            "fresh_documents": self._fresh_docs,
        }
