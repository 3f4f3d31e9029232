"""Per-shard search cost on shards of realistic size, measured in process: the profile `inferd plan search`
reads (`inferd bench-search --shard-profile --sizes 10000,100000,300000 --save-profile FILE`).

One ShardIndex (kinds/search/shard.py, the index a replica runs) grows through log entries of `batch` upserts to
each size in turn; every document is a synthetic text over a Zipf vocabulary (as benchmarks/search_lexical.py)
with a vector from a Gaussian mixture (as benchmarks/search_ann.py). At each size, after a compaction (BM25
in one base segment) and with the HNSW fresh buffer empty (sizes are multiples of `batch`, the buffer's
size), it measures on one thread (faiss.omp_set_num_threads(1)):

- CPU per query (process CPU time / queries, not wall clock: other processes do not inflate it) of
  lexical, dense (at each ef_search) and hybrid searches through `ShardIndex.search`, k = 10;
- recall@10 of the dense search at each ef_search against exact search over the shard's vectors;
- the process's resident memory, whose slope over the sizes is the memory per document.

`fit` then fits how each cost grows with the documents per shard: lexical a + b n (postings of the query
terms grow with n), dense a + b ln n (HNSW visits ~ ef log n nodes), memory a + b n (less the profile's
own copy of the vectors, 4 x dim bytes a document, kept for the exact answers), recall a + b ln n through
the two largest sizes (the trend where the plan extrapolates). A cost fit that falls with n (noise) is
replaced by the largest measured cost (dense: growing from it as ln n), a recall fit that rises by the
largest size's recall.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import faiss
import numpy as np

from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.types import Document, IndexSettings, LogEntry, ShardQuery, Upsert

SCHEMA = "inferd.search-shard-profile/1"

HTTP_COSTS = {
    "frontend_cpu_ms_base": 0.55,
    "frontend_cpu_ms_per_shard": 0.09,
    "call_overhead_cpu_ms": 0.7,
    "source": "docs/search.md, 'Throughput and latency through the HTTP API': front-end CPU per hybrid search "
    "0.62 / 0.76 / 0.90 ms at 1 / 2 / 4 shards (400/s, cached vectors; least squares: 0.55 + 0.09 x shards), "
    "replica CPU per shard call 1.2-1.5 ms of which the index's own search 0.4-0.8 ms (the rest, ~0.7 ms, is "
    "the worker protocol and the replica's hand-off)",
}
"""What a search costs outside the index library, from the HTTP runs (CPU accounting from /proc)."""


@dataclass(frozen=True)
class ShardProfileSpec:
    sizes: tuple[int, ...] = (10_000, 100_000, 300_000)
    dim: int = 384
    hnsw_m: int = 16
    ef_construction: int = 100
    ef_search: tuple[int, ...] = (16, 32, 64, 128)
    vocab: int = 50_000
    mean_len: int = 60
    query_skip_top: int = 100
    clusters: int = 1000
    queries: int = 200
    batch: int = 1000
    build_threads: int = 2
    seed: int = 0
    query_budget_s: float = 10.0


@dataclass
class SizeRow:
    docs: int
    build_s: float
    build_cpu_s: float
    rss_bytes: int
    lexical_cpu_us: float
    hybrid_cpu_us: float
    dense: dict[int, dict[str, float]] = field(default_factory=dict)
    """ef_search -> {cpu_us, recall@10}."""


class Corpus:
    """Synthetic documents (Zipf text + clustered vector) and queries, generated batch by batch."""

    def __init__(self, spec: ShardProfileSpec) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        ranks = np.arange(1, spec.vocab + 1)
        p = 1.0 / ranks**1.07
        self.p = p / p.sum()
        self.words = np.array([f"w{r}" for r in ranks])
        self.centers = self.rng.standard_normal((spec.clusters, spec.dim), dtype=np.float32)
        self.centers /= np.float32(math.sqrt(spec.dim))

    def vectors(self, n: int) -> np.ndarray:
        x = self.rng.standard_normal((n, self.spec.dim), dtype=np.float32)
        x *= np.float32(1 / math.sqrt(self.spec.dim))  # noise as large as the centres
        x += self.centers[self.rng.integers(0, len(self.centers), n)]
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return x

    def texts(self, n: int) -> list[str]:
        lengths = self.rng.poisson(self.spec.mean_len, size=n).clip(5)
        tokens = self.words[self.rng.choice(len(self.p), size=int(lengths.sum()), p=self.p)]
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        return [" ".join(tokens[bounds[i] : bounds[i + 1]]) for i in range(n)]

    def queries(self) -> list[tuple[str, np.ndarray]]:
        """2-4 terms by the same Zipf law without its most frequent ranks (stop words), and a vector."""
        skip = self.spec.query_skip_top
        q_p = self.p[skip:] / self.p[skip:].sum()
        vectors = self.vectors(self.spec.queries)
        texts = [
            " ".join(
                self.words[skip + r] for r in self.rng.choice(len(q_p), size=self.rng.integers(2, 5), p=q_p)
            )
            for _ in range(self.spec.queries)
        ]
        return list(zip(texts, vectors, strict=True))

    def entries(self, start: int, stop: int, first_seq: int, store: np.ndarray) -> Iterator[LogEntry]:
        """Log entries of `batch` upserts for documents start..stop-1 (their vectors also go to `store`)."""
        for seq, begin in enumerate(range(start, stop, self.spec.batch), first_seq):
            end = min(begin + self.spec.batch, stop)
            vectors = self.vectors(end - begin)
            store[begin:end] = vectors
            ops = [
                Upsert(doc=Document(id=f"d{begin + i}", text=text), vector=vectors[i].tobytes())
                for i, text in enumerate(self.texts(end - begin))
            ]
            yield LogEntry(seq=seq, ops=ops)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_per_call_us(calls: list[Callable[[], object]], budget_s: float) -> float:
    """Process CPU microseconds per call, over the calls in order (until budget_s of wall clock)."""
    started, cpu, done = time.perf_counter(), time.process_time(), 0
    for call in calls:
        call()
        done += 1
        if time.perf_counter() - started > budget_s:
            break
    return round((time.process_time() - cpu) / done * 1e6, 1)


def profile_shards(
    spec: ShardProfileSpec, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Grow one shard through spec.sizes and measure it at each; the profile (see `fit`) as a dict."""
    sizes = sorted(spec.sizes)
    if any(s % spec.batch for s in sizes):
        raise ValueError(f"sizes must be multiples of batch ({spec.batch}): {sizes}")
    settings = IndexSettings(
        dim=spec.dim, stopwords="none", hnsw_m=spec.hnsw_m, ef_construction=spec.ef_construction
    )
    shard = ShardIndex(settings, dense_fresh_limit=spec.batch)
    corpus = Corpus(spec)
    queries = corpus.queries()
    store = np.zeros((sizes[-1], spec.dim), dtype=np.float32)
    rows: list[SizeRow] = []
    for size in sizes:
        faiss.omp_set_num_threads(spec.build_threads)
        started, cpu = time.perf_counter(), time.process_time()
        for entry in corpus.entries(shard.documents, size, shard.applied_seq + 1, store):
            shard.apply(entry)
        shard.compact()  # BM25 in one base segment (nothing is dead: the slots stay as they are)
        row = SizeRow(
            size, round(time.perf_counter() - started, 1), round(time.process_time() - cpu, 1), 0, 0, 0
        )
        gc.collect()
        row.rss_bytes = rss_bytes()
        measure(shard, queries, store[:size], row, spec)
        rows.append(row)
        progress(f"{size:,} documents: built in {row.build_s} s; {asdict(row)}")
    return fit(spec, rows)


def measure(
    shard: ShardIndex,
    queries: list[tuple[str, np.ndarray]],
    vectors: np.ndarray,
    row: SizeRow,
    spec: ShardProfileSpec,
) -> None:
    faiss.omp_set_num_threads(1)
    exact = faiss.IndexFlatIP(spec.dim)
    exact.add(vectors)
    _, truth = exact.search(np.stack([v for _, v in queries]), 10)
    del exact

    def calls(mode: str) -> list[Callable[[], object]]:
        return [
            lambda q=ShardQuery(text=t, vector=v.tobytes(), k=10, mode=mode): shard.search(q)  # type: ignore[misc]
            for t, v in queries
        ]

    row.lexical_cpu_us = cpu_per_call_us(calls("lexical"), spec.query_budget_s)
    dense = shard._dense  # the profile sweeps ef_search over one built graph (a replica fixes it by settings)
    for ef in spec.ef_search:
        dense.ef_search = ef
        found = [shard.search(ShardQuery(vector=v.tobytes(), k=10, mode="dense")).dense for _, v in queries]
        hits = [len({int(h.id[1:]) for h in f} & set(truth[i].tolist())) for i, f in enumerate(found)]
        row.dense[ef] = {
            "cpu_us": cpu_per_call_us(calls("dense"), spec.query_budget_s),
            "recall@10": round(sum(hits) / (10 * len(queries)), 4),
        }
    dense.ef_search = shard.settings.ef_search
    row.hybrid_cpu_us = cpu_per_call_us(calls("hybrid"), spec.query_budget_s)


def linear_fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b x by least squares (b = 0 from a single point)."""
    if len(x) < 2:
        return (y[0] if y else 0.0), 0.0
    b, a = np.polyfit(np.asarray(x, dtype=float), np.asarray(y, dtype=float), 1)
    return float(a), float(b)


def cost_fit(x: list[float], y: list[float], through_zero: bool = False) -> tuple[float, float]:
    """linear_fit, but a cost does not fall as a shard grows: a falling fit (noise on a shared machine)
    becomes the largest measured cost, constant, or with `through_zero` the line from 0 through it (for
    dense search, whose cost grows as ln n: the largest cost scaled by ln n / ln n of its size)."""
    a, b = linear_fit(x, y)
    if b >= 0:
        return a, b
    top = max(range(len(y)), key=lambda i: y[i])
    return (0.0, y[top] / x[top]) if through_zero else (y[top], 0.0)


def recall_fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """linear_fit of the recall at the largest sizes; recall does not rise with n at a fixed ef on real
    data (on a mixture it can while clusters fill), so a rising fit is held at the largest measurement."""
    a, b = linear_fit(x, y)
    return (a, b) if b <= 0 else (y[-1], 0.0)


def fit(spec: ShardProfileSpec, rows: list[SizeRow]) -> dict[str, Any]:
    n = [float(r.docs) for r in rows]
    ln = [math.log(x) for x in n]
    lex_a, lex_b = cost_fit(n, [r.lexical_cpu_us for r in rows])
    mem_a, mem_b = cost_fit(n, [float(r.rss_bytes) for r in rows])
    dense: dict[str, Any] = {}
    for ef in spec.ef_search:
        cpu_a, cpu_b = cost_fit(ln, [r.dense[ef]["cpu_us"] for r in rows], through_zero=True)
        rec_a, rec_b = recall_fit(ln[-2:], [r.dense[ef]["recall@10"] for r in rows[-2:]])
        dense[str(ef)] = {
            "cpu_us": {"a": round(cpu_a, 2), "b_per_ln_doc": round(cpu_b, 3)},
            "recall@10": {"a": round(rec_a, 5), "b_per_ln_doc": round(rec_b, 6)},
        }
    return {
        "schema": SCHEMA,
        "spec": asdict(spec) | {"sizes": sorted(spec.sizes)},
        "measured_on": f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "rows": [asdict(r) | {"dense": {str(k): v for k, v in r.dense.items()}} for r in rows],
        "fit": {
            "lexical_cpu_us": {"a": round(lex_a, 2), "b_per_doc": lex_b},
            "dense": dense,
            "memory_bytes": {"a": round(mem_a), "b_per_doc": round(mem_b - 4 * spec.dim, 1)},
        },
        "http": HTTP_COSTS,
    }
