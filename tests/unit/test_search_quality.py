"""Quality metrics, and the lexical side reproducing the published Cranfield BM25 baseline (2 shards merged)."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import pytest

from inferd.kinds.search import fusion
from inferd.kinds.search.quality import evaluate, load_collection, ndcg_at, recall_at
from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.types import IndexSettings, LogEntry, ShardQuery, Upsert

ROOT = Path(__file__).resolve().parents[2]
IR = next(
    (p / "shared" / "data" / "ir" for p in ROOT.parents if (p / "shared" / "data" / "ir").is_dir()), None
)


def test_ndcg_uses_linear_gains_and_ignores_non_positive_judgements():
    qrels = {"a": 2, "b": 1, "c": 0, "d": -1}
    assert ndcg_at(["a", "b"], qrels, 10) == pytest.approx(1.0)
    dcg = 1 + 2 / math.log2(3)
    idcg = 2 + 1 / math.log2(3)
    assert ndcg_at(["b", "a", "c"], qrels, 10) == pytest.approx(dcg / idcg)
    assert ndcg_at(["c", "d"], qrels, 10) == 0.0
    assert recall_at(["c", "a", "x"], qrels, 100) == 0.5
    assert recall_at(["a"], {"a": 0}, 100) == 0.0


@pytest.mark.skipif(IR is None, reason="shared/data/ir not found beside the checkout")
def test_cranfield_bm25_over_two_shards_matches_the_published_baseline():
    collection = load_collection(IR / "cranfield")
    shards = [ShardIndex(IndexSettings()) for _ in range(2)]
    ops: list[list[Upsert]] = [[], []]
    for doc in collection.docs:
        ops[zlib.crc32(doc.id.encode()) % 2].append(Upsert(doc=doc))
    for shard, mine in zip(shards, ops, strict=True):
        shard.apply(LogEntry(seq=1, ops=mine))
    run = {}
    for qid, text in collection.queries.items():
        results = [s.search(ShardQuery(text=text, k=100, mode="lexical")) for s in shards]
        run[qid] = [h.id for h in fusion.merge([r.lexical for r in results], 100)]
    scores = evaluate(run, collection)
    assert scores["queries"] == 225
    assert scores["ndcg@10"] == pytest.approx(0.351, abs=0.01)
    assert scores["recall@100"] == pytest.approx(0.705, abs=0.01)
