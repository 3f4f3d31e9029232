"""Judged retrieval collections (the shared ir/ folder: corpus.jsonl, queries.jsonl, qrels.jsonl) and the
two metrics the baselines are given in: nDCG@10 (linear gains) and Recall@100. A judgement with
relevance <= 0 is not relevant; means are over the queries with at least one relevant document.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import msgspec

from inferd.kinds.search.types import Document

Qrels = dict[str, dict[str, int]]  # query id -> doc id -> relevance


class Collection(msgspec.Struct, frozen=True):
    docs: list[Document]
    queries: dict[str, str]  # query id -> text
    qrels: Qrels

    def judged_queries(self) -> list[str]:
        """Query ids with at least one relevant document, in file order."""
        return [q for q in self.queries if any(r > 0 for r in self.qrels.get(q, {}).values())]


def _lines(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def load_collection(path: Path) -> Collection:
    """Load one collection folder (e.g. shared/data/ir/cranfield)."""
    path = Path(path)
    docs = [
        Document(id=str(d["id"]), title=d.get("title") or "", text=d.get("text") or "")
        for d in _lines(path / "corpus.jsonl")
    ]
    queries = {str(q["id"]): q["text"] for q in _lines(path / "queries.jsonl")}
    qrels: Qrels = {}
    for j in _lines(path / "qrels.jsonl"):
        qrels.setdefault(str(j["query_id"]), {})[str(j["doc_id"])] = int(j["relevance"])
    return Collection(docs=docs, queries=queries, qrels=qrels)


def ndcg_at(ranked_ids: Sequence[str], qrels: Mapping[str, int], k: int = 10) -> float:
    """nDCG@k with linear gains (gain = relevance, relevance <= 0 counts 0)."""
    gains = [max(qrels.get(doc, 0), 0) for doc in ranked_ids[:k]]
    dcg = sum(g / math.log2(i + 2) for i, g in enumerate(gains))
    ideal = sorted((r for r in qrels.values() if r > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def recall_at(ranked_ids: Sequence[str], qrels: Mapping[str, int], k: int = 100) -> float:
    """The share of relevant documents found in the first k."""
    relevant = {doc for doc, r in qrels.items() if r > 0}
    if not relevant:
        return 0.0
    return len(relevant.intersection(ranked_ids[:k])) / len(relevant)


def evaluate(run: Mapping[str, Sequence[str]], collection: Collection) -> dict[str, float]:
    """Mean nDCG@10 and Recall@100 of a run (query id -> ranked doc ids) over the judged queries."""
    judged = collection.judged_queries()
    ndcg = [ndcg_at(run.get(q, []), collection.qrels[q], 10) for q in judged]
    recall = [recall_at(run.get(q, []), collection.qrels[q], 100) for q in judged]
    return {
        "queries": float(len(judged)),
        "ndcg@10": sum(ndcg) / len(judged) if judged else 0.0,
        "recall@100": sum(recall) / len(judged) if judged else 0.0,
    }
