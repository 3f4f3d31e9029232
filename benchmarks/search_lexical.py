"""Lexical search speed: synthetic documents over a Zipf vocabulary, one thread.

Builds the library's BM25 index (inferd.kinds.search.lexical, through ShardIndex log entries of 100 upserts, the
way a shard takes them) and, for comparison, a bm25s index of the same tokens; then times the same queries
on both, single-threaded, and times what keeping bm25s exact would cost per update (a full rebuild).
Query terms (2 to 4) follow the same Zipf distribution as the text without its --query-skip-top most
frequent ranks (those stand for stop words, which the analyzer drops from real queries).

    PYTHONPATH=src python benchmarks/search_lexical.py [--docs 100000] [--queries 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import bm25s
import numpy as np

from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.types import Document, IndexSettings, LogEntry, ShardQuery, Upsert


def corpus(docs: int, vocab: int, mean_len: int, seed: int) -> tuple[list[str], np.ndarray]:
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab + 1)
    p = 1.0 / ranks**1.07
    p /= p.sum()
    words = np.array([f"w{r}" for r in ranks])
    lengths = rng.poisson(mean_len, size=docs).clip(5)
    tokens = words[rng.choice(vocab, size=int(lengths.sum()), p=p)]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    texts = [" ".join(tokens[bounds[i] : bounds[i + 1]]) for i in range(docs)]
    return texts, p


def timed_queries(search, queries: list[str], budget_s: float) -> dict[str, float]:
    """Queries/s by wall clock and by this process's CPU time (one thread: per core, whatever the load)."""
    started, cpu = time.perf_counter(), time.process_time()
    done = 0
    for q in queries:
        search(q)
        done += 1
        if time.perf_counter() - started > budget_s:
            break
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"queries": done, "qps_wall": round(done / wall), "qps_per_cpu_s": round(done / cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--mean-len", type=int, default=60)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--query-skip-top", type=int, default=100, help="ranks left out of queries")
    parser.add_argument("--budget-s", type=float, default=60.0, help="time limit of each query loop")
    args = parser.parse_args()
    out: dict[str, object] = {"docs": args.docs, "vocab": args.vocab, "mean_len": args.mean_len}

    t = time.perf_counter()
    texts, p = corpus(args.docs, args.vocab, args.mean_len, seed=1)
    rng = np.random.default_rng(2)
    skip = args.query_skip_top  # the most frequent ranks stand for stop words: queries leave them out
    q_p = p[skip:] / p[skip:].sum()
    queries = [
        " ".join(f"w{r + 1 + skip}" for r in rng.choice(len(q_p), size=rng.integers(2, 5), p=q_p))
        for _ in range(args.queries)
    ]
    out["generate_s"] = round(time.perf_counter() - t, 1)

    shard = ShardIndex(IndexSettings(stopwords="none"))
    t = time.perf_counter()
    for start in range(0, args.docs, 100):
        ops = [
            Upsert(doc=Document(id=str(i), text=texts[i])) for i in range(start, min(start + 100, args.docs))
        ]
        shard.apply(LogEntry(seq=shard.applied_seq + 1, ops=ops))
    out["inferd_index_s"] = round(time.perf_counter() - t, 1)
    out["inferd_stats"] = shard.statistics()["lexical"]

    def ours(q: str) -> object:
        return shard.search(ShardQuery(text=q, k=args.k, mode="lexical"))

    out["inferd_search"] = timed_queries(ours, queries, args.budget_s)

    t = time.perf_counter()
    tokenized = bm25s.tokenize(texts, stopwords=None, show_progress=False)
    retriever = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
    retriever.index(tokenized, show_progress=False)
    out["bm25s_index_s"] = round(time.perf_counter() - t, 1)
    vocab = tokenized.vocab

    def theirs(q: str) -> object:
        ids = [vocab[w] for w in q.split() if w in vocab]
        scores = retriever.get_scores_from_ids(ids)
        return np.argpartition(-scores, args.k)[: args.k]

    out["bm25s_search"] = timed_queries(theirs, queries, args.budget_s)

    def same_scores(q: str) -> bool:  # the same top-k scores (ties may pick other ids at the k-th place)
        mine = sorted(h.score for h in ours(q).lexical)  # type: ignore[attr-defined]
        scores = retriever.get_scores_from_ids([vocab[w] for w in q.split() if w in vocab])
        top = sorted(s for s in scores[theirs(q)].tolist() if s > 0)
        return len(mine) == len(top) and bool(np.allclose(mine, top, rtol=1e-4))

    out["same_top10_scores_of_100_queries"] = sum(same_scores(q) for q in queries[:100])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
