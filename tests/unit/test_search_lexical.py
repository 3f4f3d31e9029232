"""BM25 of the index library against a brute-force BM25 over the live documents (k1 0.9, b 0.4, Lucene idf):
after any order of upserts and deletes (merges and compactions included) the scores equal those of a
from-scratch index of what is live."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.kinds.search.analyzer import STOP_LISTS, document_text, tokenize
from inferd.kinds.search.lexical import LexicalIndex
from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.types import Delete, Document, IndexSettings, LogEntry, ShardQuery, Upsert

WORDS = ["apple", "banana", "cherry", "delta", "echo", "fox", "golf", "hotel", "the", "and"]
SETTINGS = IndexSettings(dim=4)


def brute_bm25(docs: list[Document], query: str, k1: float = 0.9, b: float = 0.4) -> dict[str, float]:
    """Every live document with a positive score, scored from scratch."""
    tokens = {d.id: tokenize(document_text(d.title, d.text)) for d in docs}
    n = len(docs)
    if n == 0:
        return {}
    avgdl = sum(len(t) for t in tokens.values()) / n
    df = Counter(t for ts in tokens.values() for t in set(ts))
    scores: dict[str, float] = {}
    for doc_id, ts in tokens.items():
        tf = Counter(ts)
        score = 0.0
        for term in tokenize(query):
            if tf[term]:
                idf = math.log(1 + (n - df[term] + 0.5) / (df[term] + 0.5))
                score += idf * tf[term] / (tf[term] + k1 * (1 - b + b * len(ts) / avgdl))
        if score > 0:
            scores[doc_id] = score
    return scores


def test_en_plus_is_the_179_word_nltk_list():
    assert len(STOP_LISTS["en_plus"]) == 179
    assert len(set(STOP_LISTS["en_plus"])) == 179
    assert {"the", "and", "ourselves", "wouldn't"} <= set(STOP_LISTS["en_plus"])


def test_tokenize_lowercases_splits_on_non_alphanumerics_and_drops_stop_words():
    assert tokenize("The Quick-brown FOX, 42 times; and x2!") == [
        "quick",
        "brown",
        "fox",
        "42",
        "times",
        "x2",
    ]
    assert tokenize("running runs ran") == ["running", "runs", "ran"]  # no stemming
    assert tokenize("the and", stopwords="none") == ["the", "and"]


def test_scores_equal_brute_force_and_removed_documents_leave_the_statistics():
    docs = [
        Document(id=str(i), text=" ".join(WORDS[j % 8] for j in range(i, i + 2 + i % 5))) for i in range(12)
    ]
    index = LexicalIndex(fresh_limit=5)
    for d in docs:
        index.add(tokenize(d.text))
    for slot in (1, 4, 7):
        index.remove(slot)
    live = [d for i, d in enumerate(docs) if i not in (1, 4, 7)]
    slots, scores = index.search(tokenize("apple fox golf"), 100)
    got = {docs[s].id: sc for s, sc in zip(slots.tolist(), scores.tolist(), strict=True)}
    want = brute_bm25(live, "apple fox golf")
    assert got.keys() == want.keys()
    for doc_id, score in want.items():
        assert math.isclose(got[doc_id], score, rel_tol=1e-5)


def test_top_k_is_best_first_with_ties_to_the_lower_slot():
    index = LexicalIndex()
    for text in ["apple", "banana", "apple", "apple apple cherry", "apple"]:
        index.add(tokenize(text))
    slots, scores = index.search(["apple"], 3)
    assert list(np.diff(scores) <= 0) == [True, True]
    assert slots.tolist()[1:] == [0, 2]  # three docs tie on "apple"; the lower slots win


doc_ids = st.sampled_from([f"d{i}" for i in range(8)])
texts = st.lists(st.sampled_from(WORDS), min_size=0, max_size=7).map(" ".join)


def unit_vector(seed: int) -> bytes:
    v = np.random.default_rng(seed).normal(size=4).astype("<f4")
    return (v / np.linalg.norm(v)).tobytes()


upserts = st.builds(
    lambda i, t, title, seed: Upsert(doc=Document(id=i, text=t, title=title), vector=unit_vector(seed)),
    doc_ids,
    texts,
    texts,
    st.integers(0, 10**6),
)
ops = st.one_of(
    upserts,
    st.builds(lambda i: Delete(id=i), doc_ids),
)


def entries_of(op_list: list, sizes: list[int]) -> list[LogEntry]:
    entries, start, seq = [], 0, 1
    for size in sizes:
        if start >= len(op_list):
            break
        entries.append(LogEntry(seq=seq, ops=op_list[start : start + size]))
        start += size
        seq += 1
    if start < len(op_list):
        entries.append(LogEntry(seq=seq, ops=op_list[start:]))
    return entries


def live_documents(op_list: list) -> dict[str, Document]:
    live: dict[str, Document] = {}
    for op in op_list:
        if isinstance(op, Upsert):
            live[op.doc.id] = op.doc
        else:
            live.pop(op.id, None)
    return live


def last_upserts(op_list: list) -> dict[str, Upsert]:
    live: dict[str, Upsert] = {}
    for op in op_list:
        if isinstance(op, Upsert):
            live[op.doc.id] = op
        else:
            live.pop(op.id, None)
    return live


def lexical_scores(shard: ShardIndex, query: str) -> dict[str, float]:
    result = shard.search(ShardQuery(text=query, k=100, mode="lexical"))
    return {h.id: h.score for h in result.lexical}


@settings(max_examples=150, deadline=None)
@given(
    op_list=st.lists(ops, min_size=1, max_size=40),
    sizes=st.lists(st.integers(1, 5), max_size=40),
    queries=st.lists(
        st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map(" ".join), min_size=1, max_size=3
    ),
)
def test_any_order_of_upserts_and_deletes_scores_like_an_index_rebuilt_from_scratch(op_list, sizes, queries):
    shard = ShardIndex(
        SETTINGS, lexical_fresh_limit=3, dense_fresh_limit=2, compact_fraction=0.3, compact_min_dead=2
    )
    for entry in entries_of(op_list, sizes):
        shard.apply(entry)
        shard.apply(entry)  # a replayed entry changes nothing
    live = live_documents(op_list)
    rebuilt = ShardIndex(SETTINGS)
    rebuilt.apply(LogEntry(seq=1, ops=[Upsert(doc=d) for d in live.values()]))
    assert shard.documents == len(live)
    for doc_id in {f"d{i}" for i in range(8)}:
        assert shard.get(doc_id) == live.get(doc_id)
    probe = unit_vector(7)
    dense = shard.search(ShardQuery(vector=probe, k=100, mode="dense")).dense
    exact = sorted(
        (
            (-float(np.frombuffer(probe, "<f4") @ np.frombuffer(u.vector, "<f4")), d)
            for d, u in last_upserts(op_list).items()
        )
    )
    assert {h.id for h in dense} == {d for _, d in exact}  # every live vector, by exact score
    assert [h.score for h in dense] == pytest.approx([-score for score, _ in exact], abs=1e-6)
    for query in queries:
        got, want, fresh = (
            lexical_scores(shard, query),
            brute_bm25(list(live.values()), query),
            lexical_scores(rebuilt, query),
        )
        assert got.keys() == want.keys() == fresh.keys()
        for doc_id, score in want.items():
            assert math.isclose(got[doc_id], score, rel_tol=1e-5)
            assert math.isclose(fresh[doc_id], score, rel_tol=1e-5)
