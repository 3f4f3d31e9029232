"""What shadow traffic costs the primary: sim v1 and v2 served side by side, once without a traffic table
and once with `shadow = { version = 2, fraction = 0.2 }`; the same closed-loop load (a fixed number of
OIP infer requests from `--concurrency` clients) on each, interleaved run by run so both see the same
machine load; the primary's p99 is compared as the median over the runs.

    .venv/bin/python benchmarks/shadow.py [--runs 3] [--requests 1500] [--concurrency 8] [--v2-wait-ms 2]

Writes .bench/shadow.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time
import urllib.request
from typing import Any

import aiohttp
from harness import OUT_DIR, InferdServer, write_json

MODEL = """builtin = "sim"
workers = 1
version_policy = "all"
default_version = 1
max_wait_ms = 2
{traffic}
[params]
base_ms = 5.0

[versions.1]

[versions.2]
max_wait_ms = {v2_wait_ms}
"""
SHADOW = "traffic = { shadow = { version = 2, fraction = 0.2 } }"


async def load(url: str, requests: int, concurrency: int) -> list[float]:
    """Latencies (s) of `requests` OIP infer calls from `concurrency` clients, each waiting for its
    answer before the next; every answer must be v1's."""
    latencies: list[float] = []
    next_id = iter(range(requests))

    async def client(http: aiohttp.ClientSession) -> None:
        for i in next_id:
            body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [f"r{i}"]}]}
            start = time.perf_counter()
            async with http.post(f"{url}/v2/models/sim/infer", json=body) as r:
                out = await r.json()
            latencies.append(time.perf_counter() - start)
            if r.status != 200 or out["model_version"] != "1":
                raise RuntimeError(f"request {i}: {r.status} {out}")

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return latencies


def p99_ms(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000


def shadow_counts(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for m in re.finditer(r'inferd_shadow_requests_total\{[^}]*result="(\w+)"[^}]*\} (\S+)', text):
        counts[m.group(1)] = counts.get(m.group(1), 0.0) + float(m.group(2))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--v2-wait-ms", type=float, default=2.0, help="max_wait_ms of v2 (the shadow version); v1's is 2"
    )
    args = parser.parse_args()
    setups = {
        name: MODEL.format(traffic=traffic, v2_wait_ms=args.v2_wait_ms)
        for name, traffic in (("without", ""), ("shadow_0.2", SHADOW))
    }
    p99s: dict[str, list[float]] = {name: [] for name in setups}
    medians: dict[str, list[float]] = {name: [] for name in setups}
    servers = {  # one server per setup, both up for the whole run
        name: InferdServer(
            "--no-admin", "--log-level", "WARNING", name=f"shadow-{name}", models={"sim": model}
        )
        for name, model in setups.items()
    }
    with servers["without"], servers["shadow_0.2"]:
        for server in servers.values():  # warm-up, not measured
            asyncio.run(load(server.url, 200, args.concurrency))
        for _ in range(args.runs):
            for name, server in servers.items():
                samples = asyncio.run(load(server.url, args.requests, args.concurrency))
                p99s[name].append(p99_ms(samples))
                medians[name].append(statistics.median(samples) * 1000)
        counts = shadow_counts(servers["shadow_0.2"].url)
    result: dict[str, Any] = {
        "runs": args.runs,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "v2_wait_ms": args.v2_wait_ms,
        "p99_ms": p99s,
        "p50_ms": medians,
        "median_p99_ms": {name: statistics.median(v) for name, v in p99s.items()},
        "shadow_requests": counts,
    }
    base, shadow = result["median_p99_ms"]["without"], result["median_p99_ms"]["shadow_0.2"]
    result["p99_change"] = shadow / base - 1.0
    write_json(OUT_DIR / "shadow.json", result)
    print("| setup | p99 ms per run | median p99 ms | p50 ms per run |\n|---|---|---|---|")
    for name in setups:
        runs = ", ".join(f"{v:.2f}" for v in p99s[name])
        p50 = ", ".join(f"{v:.2f}" for v in medians[name])
        print(f"| {name} | {runs} | {result['median_p99_ms'][name]:.2f} | {p50} |")
    print(f"\np99 change with shadow at 0.2: {100 * result['p99_change']:+.1f} %; shadow copies: {counts}")


if __name__ == "__main__":
    main()
