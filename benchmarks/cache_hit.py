"""What a response cache hit costs.

1. In process: `request_key` + `ResponseCache.get_or_compute` on a stored answer, for a request of 1 and
   of 64 sim items (what the cache adds to a hit, before encoding).
2. Over HTTP: one keep-alive connection, sequential requests to a real `inferd serve` with sim at
   `cache = { enabled = true }`: OIP infer hits of the same request, against GET /v2/models/sim (model
   metadata: the same chain and route lookup, no model work) as the floor of a round trip.

    .venv/bin/python benchmarks/cache_hit.py [--requests 2000]

Writes .bench/cache_hit.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import time
from typing import Any

from harness import OUT_DIR, InferdServer, write_json

from inferd.clock import MonotonicClock
from inferd.config.cache import CacheConfig
from inferd.gateway.cache import ResponseCache, request_key

CONFIG = "[models.sim]\ncache = { enabled = true }\n"


def quantiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "mean_ms": statistics.fmean(ordered) * 1000}


def in_process(n: int, items: int) -> dict[str, float]:
    cache: ResponseCache[Any] = ResponseCache(CacheConfig(enabled=True), MonotonicClock())
    canonical = ("oip", [f"text-{i}".encode() for i in range(items)], ["OUTPUT0"])

    async def compute() -> tuple[Any, int]:
        return [{"OUTPUT0": b"x" * 32}] * items, 64 * items

    async def run() -> list[float]:
        await cache.get_or_compute(request_key("", "sim", 1, canonical), compute)
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            _, lookup = await cache.get_or_compute(request_key("", "sim", 1, canonical), compute)
            samples.append(time.perf_counter() - start)
            assert lookup == "hit"
        return samples

    return quantiles(asyncio.run(run()))


def over_http(port: int, n: int) -> dict[str, dict[str, float]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["hello"]}]}
    ).encode()

    def timed(method: str, path: str, payload: bytes | None, want_cache: str | None) -> float:
        start = time.perf_counter()
        conn.request(method, path, payload, {"Content-Type": "application/json"} if payload else {})
        resp = conn.getresponse()
        resp.read()
        elapsed = time.perf_counter() - start
        if resp.status != 200 or (want_cache and resp.getheader("x-inferd-cache") != want_cache):
            raise RuntimeError(f"{path}: {resp.status} cache={resp.getheader('x-inferd-cache')}")
        return elapsed

    timed("POST", "/v2/models/sim/infer", body, None)  # the miss that stores it
    for _ in range(100):  # warm both paths
        timed("POST", "/v2/models/sim/infer", body, "hit")
        timed("GET", "/v2/models/sim", None, None)
    hits, floor = [], []
    for _ in range(n):  # interleaved, so both see the same machine load
        hits.append(timed("POST", "/v2/models/sim/infer", body, "hit"))
        floor.append(timed("GET", "/v2/models/sim", None, None))
    conn.close()
    return {"infer_hit": quantiles(hits), "metadata_floor": quantiles(floor)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    result: dict[str, Any] = {"requests": args.requests, "in_process": {}}
    for items in (1, 64):
        result["in_process"][f"{items}_items"] = in_process(args.requests, items)
    with InferdServer(
        "--model", "sim", "--no-admin", "--log-level", "WARNING", name="cache-hit", config=CONFIG
    ) as server:
        result["http"] = over_http(server.port, args.requests)
    write_json(OUT_DIR / "cache_hit.json", result)
    print("| what | p50 ms | p99 ms | mean ms |\n|---|---|---|---|")
    rows = {f"in process, hit of {k.replace('_', ' ')}": v for k, v in result["in_process"].items()}
    rows |= {"HTTP: OIP infer, cache hit": result["http"]["infer_hit"]}
    rows |= {"HTTP: GET model metadata (floor)": result["http"]["metadata_floor"]}
    for name, q in rows.items():
        print(f"| {name} | {q['p50_ms']:.3f} | {q['p99_ms']:.3f} | {q['mean_ms']:.3f} |")


if __name__ == "__main__":
    main()
