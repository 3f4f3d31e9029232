"""ANN recall and speed: faiss HNSW (inner product, L2-normalised vectors) on a synthetic Gaussian mixture.

Adds vectors in chunks until --n or until the build has taken --build-budget-s (then reports the size it
reached), measures recall@10 against exact search (faiss IndexFlatIP) and queries/s on ONE thread
(faiss.omp_set_num_threads(1), one query per call, as a shard answers them) for each efSearch (by wall clock and per CPU-second of
the process, the latter meaningful on a shared machine); the build itself uses every core. Recall and q/s are also taken at half the size, to show the trend with n.

    PYTHONPATH=src python benchmarks/search_ann.py [--n 1000000] [--dim 128] [--m 16] [--ef-construction 100]
"""

from __future__ import annotations

import argparse
import json
import time

import faiss
import numpy as np


def mixture(n: int, dim: int, centers: np.ndarray, rng: np.random.Generator, spread: float) -> np.ndarray:
    x = centers[rng.integers(0, len(centers), n)] + spread * rng.normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def measure(
    index: faiss.IndexHNSWFlat, data: np.ndarray, queries: np.ndarray, efs: list[int], budget_s: float
) -> dict:
    exact = faiss.IndexFlatIP(data.shape[1])
    exact.add(data)
    faiss.omp_set_num_threads(faiss.omp_get_max_threads() or 1)
    _, truth = exact.search(queries, 10)
    faiss.omp_set_num_threads(1)
    rows = {}
    for ef in efs:
        index.hnsw.efSearch = ef
        _, found = index.search(queries, 10)
        recall = np.mean([len(set(found[i]) & set(truth[i])) / 10 for i in range(len(queries))])
        started, cpu, done = time.perf_counter(), time.process_time(), 0
        for q in queries:
            index.search(q[None, :], 10)
            done += 1
            if time.perf_counter() - started > budget_s:
                break
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        rows[ef] = {
            "recall@10": round(float(recall), 4),
            "qps_1_thread_wall": round(done / wall),
            "qps_per_cpu_s": round(done / cpu),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--ef-construction", type=int, default=100)
    parser.add_argument("--ef-search", default="32,64,128,256")
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--spread", type=float, default=1.0, help="noise around each cluster centre")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=25_000)
    parser.add_argument("--build-budget-s", type=float, default=300.0)
    parser.add_argument("--query-budget-s", type=float, default=20.0, help="time limit of each q/s loop")
    args = parser.parse_args()
    efs = [int(e) for e in args.ef_search.split(",")]
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(args.clusters, args.dim)).astype(np.float32) / np.sqrt(args.dim)
    queries = mixture(args.queries, args.dim, centers, rng, args.spread / np.sqrt(args.dim))
    index = faiss.IndexHNSWFlat(args.dim, args.m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = args.ef_construction
    parts: list[np.ndarray] = []
    started = time.perf_counter()
    half_result = None
    while index.ntotal < args.n and time.perf_counter() - started < args.build_budget_s:
        chunk = mixture(
            min(args.chunk, args.n - index.ntotal), args.dim, centers, rng, args.spread / np.sqrt(args.dim)
        )
        index.add(chunk)
        parts.append(chunk)
    build_s = time.perf_counter() - started
    data = np.concatenate(parts)
    out: dict[str, object] = {
        "dim": args.dim,
        "m": args.m,
        "ef_construction": args.ef_construction,
        "threads_build": faiss.omp_get_max_threads(),
        "n": int(index.ntotal),
        "build_s": round(build_s, 1),
        "build_vectors_per_s": round(index.ntotal / build_s),
    }
    half = faiss.IndexHNSWFlat(args.dim, args.m, faiss.METRIC_INNER_PRODUCT)  # the first half, for the trend
    half.hnsw.efConstruction = args.ef_construction
    half.add(data[: len(data) // 2])
    half_result = measure(half, data[: len(data) // 2], queries, efs, args.query_budget_s)
    out["at_half_n"] = {"n": len(data) // 2, **{f"ef{k}": v for k, v in half_result.items()}}
    out["at_n"] = {f"ef{k}": v for k, v in measure(index, data, queries, efs, args.query_budget_s).items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
