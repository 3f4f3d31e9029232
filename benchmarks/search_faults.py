"""One replica slowed 10x under load against fault-free, alternately: is the search p99 within 1.3x?

Against a running server (the 2-shard, 2-replica index, its query vectors cached), runs `inferd
bench-search`'s load (bench/search.py, the same code) fault-free, then with one replica of shard 0
slowed (`--slow-at-s 3 --slow-s 15 --slow-factor 10`), `--rounds` times, alternately so both see the
same machine; prints each run (with the load average before it) and each slow run's p99 against the
median fault-free p99, and against the mean of the fault-free runs either side of it.

    PYTHONPATH=src .venv/bin/python -m inferd.cli.main serve --model minilm --port 8747 --data-dir DIR \\
        --no-admin --config serve.toml &
    PYTHONPATH=src .venv/bin/python benchmarks/search_faults.py --url http://127.0.0.1:8747 \\
        --index all-s2r2 --queries all-queries.jsonl --warm [--rounds 3] [--out .bench/search_faults.json]

Bounded: `--rounds` x 2 runs of `--duration-s` (plus the last fault-free run), each stopped after
`--duration-s` + 60 s; `--warm` searches every query once first (closed loop, at most 10 tries each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from inferd.bench.search import BenchSpec, read_queries, run_bench


def warm(url: str, index: str, queries: list[tuple[str, str]]) -> int:
    """Search every query once (its vector cached), again while the answer says degraded; how many never
    came back whole."""
    missing = 0
    for _, text in queries:
        for _ in range(10):
            body = {"query": text[:4000], "mode": "hybrid", "k": 10, "cache": False, "timeout_ms": 5000}
            request = urllib.request.Request(
                f"{url}/v1/indexes/{index}/search",
                data=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as r:  # nosec B310  # a local server
                if not json.loads(r.read())["degraded"]:
                    break
            time.sleep(1.0)
        else:
            missing += 1
    return missing


def one_run(args: argparse.Namespace, queries: list[tuple[str, str]], slow: bool) -> dict[str, Any]:
    spec = BenchSpec(
        url=args.url,
        index=args.index,
        queries=queries,
        qrels={},
        rate=args.rate,
        duration_s=args.duration_s,
        mode="hybrid",
        seed=args.seed,
        slow_at_s=3.0 if slow else None,
        slow_s=15.0,
        slow_factor=10.0 if slow else None,
        result_cache=False,
    )
    load = os.getloadavg()
    report = asyncio.run(asyncio.wait_for(run_bench(spec), args.duration_s + 60))
    return {
        "run": "slow x10" if slow else "fault-free",
        "load_before": [round(x, 2) for x in load],
        "p50_ms": report.latency_ms["p50"],
        "p99_ms": report.latency_ms["p99"],
        "max_ms": report.latency_ms["max"],
        "statuses": report.statuses,
        "partial": report.partial,
        "hedges": report.hedge,
        "faults": report.faults,
    }


def summary(runs: list[dict[str, Any]]) -> list[str]:
    base = [r["p99_ms"] for r in runs if r["run"] == "fault-free"]
    median = statistics.median(base)
    lines = [f"fault-free p99: {', '.join(f'{b:.1f}' for b in base)} ms (median {median:.1f})"]
    for i, r in enumerate(runs):
        if r["run"] == "fault-free":
            continue
        either_side = [runs[j]["p99_ms"] for j in (i - 1, i + 1) if 0 <= j < len(runs)]
        lines.append(
            f"slow p99 {r['p99_ms']:.1f} ms: {r['p99_ms'] / median:.2f}x the median, "
            f"{r['p99_ms'] / statistics.mean(either_side):.2f}x the runs either side; "
            f"hedges {r['hedges']['share']:.1%}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8747")
    parser.add_argument("--index", default="all-s2r2")
    parser.add_argument("--queries", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm", action="store_true", help="Cache every query's vector first.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    queries = read_queries(args.queries)
    if args.warm:
        print(f"warm: {warm(args.url, args.index, queries)} queries not cached", flush=True)
    runs = []
    for slow in [False, True] * args.rounds + [False]:
        runs.append(one_run(args, queries, slow))
        r = runs[-1]
        print(
            f"{r['run']:10s} load {r['load_before'][0]:5.2f}  p50 {r['p50_ms']:6.1f}  p99 {r['p99_ms']:6.1f}"
            f"  max {r['max_ms']:6.1f} ms  {r['statuses']}  partial {r['partial']}"
            f"  hedges {r['hedges']['hedges']} of {r['hedges']['requests']} ({r['hedges']['share']:.1%})",
            flush=True,
        )
    for line in summary(runs):
        print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": runs, "summary": summary(runs)}, indent=2))


if __name__ == "__main__":
    main()
