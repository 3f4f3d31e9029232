"""ANN recall and speed: faiss HNSW (inner product, L2-normalised vectors) on a synthetic Gaussian mixture.

Adds vectors in chunks (faiss's own threads, --build-threads) until --n or until the build has taken
--build-budget-s (then reports the size it reached; the default budget is 25 minutes, a bound, not a target),
measures recall@10 against exact search (faiss IndexFlatIP over the whole set, for the --queries held-out
queries) and queries/s on ONE thread (faiss.omp_set_num_threads(1), one query per call, as a shard answers
them) for each efSearch, by wall clock and per CPU-second of the process: on a shared machine the
latter is the figure (CPU-seconds per query do not depend on what else runs). With --trend the same is
measured at half the size (a second build: half as long again).

    nice -n 19 env PYTHONPATH=src python benchmarks/search_ann.py [--n 1000000] [--dim 128] [--m 16] \
        [--ef-construction 100] [--build-threads 2] [--trend]
"""

from __future__ import annotations

import argparse
import json
import time

import faiss
import numpy as np


def mixture(n: int, centers: np.ndarray, rng: np.random.Generator, spread: float) -> np.ndarray:
    """n points around centres drawn uniformly, Gaussian noise of `spread` per coordinate, L2-normalised;
    float32 throughout (1M x 128 is 512 MB)."""
    x = rng.standard_normal(size=(n, centers.shape[1]), dtype=np.float32)
    x *= np.float32(spread)
    x += centers[rng.integers(0, len(centers), n)]
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def exact_top(data: np.ndarray, queries: np.ndarray, k: int, threads: int) -> np.ndarray:
    exact = faiss.IndexFlatIP(data.shape[1])
    exact.add(data)
    faiss.omp_set_num_threads(threads)
    _, truth = exact.search(queries, k)
    return truth


def measure(
    index: faiss.IndexHNSWFlat, truth: np.ndarray, queries: np.ndarray, efs: list[int], budget_s: float
) -> dict[int, dict[str, float]]:
    faiss.omp_set_num_threads(1)
    rows = {}
    for ef in efs:
        index.hnsw.efSearch = ef
        _, found = index.search(queries, 10)
        recall = np.mean([len(set(found[i]) & set(truth[i])) / 10 for i in range(len(queries))])
        started, cpu, done = time.perf_counter(), time.process_time(), 0
        while time.perf_counter() - started < min(3.0, budget_s):  # whole passes, at least 3 s
            for q in queries:
                index.search(q[None, :], 10)
                done += 1
                if time.perf_counter() - started > budget_s:
                    break
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        rows[ef] = {
            "recall@10": round(float(recall), 4),
            "queries_timed": done,
            "qps_1_thread_wall": round(done / wall),
            "qps_per_cpu_s": round(done / cpu),
            "cpu_us_per_query": round(cpu / done * 1e6, 1),
        }
    return rows


def build(data_chunks, dim: int, m: int, ef_c: int, threads: int, budget_s: float) -> tuple:
    """An HNSW index of the chunks, added in order until the budget ends; (index, parts, wall_s, cpu_s)."""
    index = faiss.IndexHNSWFlat(dim, m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_c
    faiss.omp_set_num_threads(threads)
    parts: list[np.ndarray] = []
    started, cpu = time.perf_counter(), time.process_time()
    for chunk in data_chunks:
        if time.perf_counter() - started >= budget_s:
            break
        index.add(chunk)
        parts.append(chunk)
    return index, parts, time.perf_counter() - started, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--ef-construction", type=int, default=100)
    parser.add_argument("--ef-search", default="32,48,64,96,128,256")
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--spread", type=float, default=1.0, help="noise around each cluster centre")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=50_000)
    parser.add_argument("--build-threads", type=int, default=2, help="faiss threads for add and exact search")
    parser.add_argument("--build-budget-s", type=float, default=1500.0)
    parser.add_argument("--query-budget-s", type=float, default=20.0, help="time limit of each q/s loop")
    parser.add_argument("--trend", action="store_true", help="also build and measure half the size")
    args = parser.parse_args()
    efs = [int(e) for e in args.ef_search.split(",")]
    rng = np.random.default_rng(0)
    centers = rng.standard_normal(size=(args.clusters, args.dim), dtype=np.float32) / np.sqrt(args.dim)
    spread = args.spread / np.sqrt(args.dim)
    queries = mixture(args.queries, centers, rng, spread)
    t = time.perf_counter()
    sizes = [min(args.chunk, args.n - s) for s in range(0, args.n, args.chunk)]
    chunks = [mixture(size, centers, rng, spread) for size in sizes]
    generate_s = time.perf_counter() - t
    index, parts, build_s, build_cpu_s = build(
        chunks, args.dim, args.m, args.ef_construction, args.build_threads, args.build_budget_s
    )
    data = np.concatenate(parts)
    del chunks
    t = time.perf_counter()
    truth = exact_top(data, queries, 10, args.build_threads)
    out: dict[str, object] = {
        "dim": args.dim,
        "clusters": args.clusters,
        "m": args.m,
        "ef_construction": args.ef_construction,
        "build_threads": args.build_threads,
        "n": int(index.ntotal),
        "generate_s": round(generate_s, 1),
        "build_s": round(build_s, 1),
        "build_cpu_s": round(build_cpu_s, 1),
        "build_vectors_per_s": round(index.ntotal / build_s),
        "exact_truth_s": round(time.perf_counter() - t, 1),
        "index_bytes_per_vector": round(len(faiss.serialize_index(index)) / index.ntotal, 1),
    }
    out["at_n"] = {f"ef{k}": v for k, v in measure(index, truth, queries, efs, args.query_budget_s).items()}
    print(json.dumps(out, indent=1), flush=True)
    if args.trend:
        del index
        half_n = len(data) // 2
        half, _, half_s, _ = build(
            [data[:half_n]], args.dim, args.m, args.ef_construction, args.build_threads, float("inf")
        )
        truth = exact_top(data[:half_n], queries, 10, args.build_threads)
        rows = measure(half, truth, queries, efs, args.query_budget_s)
        out["at_half_n"] = {
            "n": half_n,
            "build_s": round(half_s, 1),
            **{f"ef{k}": v for k, v in rows.items()},
        }
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
