"""What a response cache hit costs with `cache.store = "redis"` (against the memory store).

Starts a throwaway redis-server on loopback (no persistence), then:
1. In process: `request_key` + `RedisResponseCache.get_or_compute` on a stored answer (1 and 64 sim
   items): one Lua script round trip to Redis and the msgpack decode of the answer.
2. Over HTTP: one keep-alive connection, sequential requests to a real `inferd serve` with sim at
   `cache = { enabled = true, store = "redis" }`: OIP infer hits against GET /v2/models/sim (the floor
   of a round trip), as benchmarks/cache_hit.py measures them for the memory store.

    .venv/bin/python benchmarks/cache_hit_redis.py [--requests 1000]

Bounded: --requests hits per row (at most 20000). Writes .bench/cache_hit_redis.json and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import time
from typing import Any

from cache_hit import in_process as memory_in_process
from cache_hit import over_http, quantiles
from harness import OUT_DIR, InferdServer, free_port, write_json

from inferd.clock import MonotonicClock
from inferd.config.cache import CacheConfig
from inferd.gateway.cache import request_key
from inferd.gateway.redis_cache import RedisCacheClient, RedisResponseCache


def start_redis(port: int) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (scripts/setup --test installs it)")
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"redis-server on port {port} did not answer PING in 10 s")


def in_process(url: str, n: int, items: int) -> dict[str, float]:
    canonical = ("oip", [f"text-{i}".encode() for i in range(items)], ["OUTPUT0"])

    async def compute() -> tuple[Any, int]:
        return [{"OUTPUT0": b"x" * 32}] * items, 64 * items

    async def run() -> list[float]:
        clock = MonotonicClock()
        client = RedisCacheClient(url, clock, timeout_ms=1000)
        config = CacheConfig(enabled=True, store="redis")
        cache: RedisResponseCache[Any] = RedisResponseCache(config, clock, client, ("sim", 1), print)
        try:
            await cache.get_or_compute(request_key("", "sim", 1, canonical), compute)
            samples = []
            for _ in range(n):
                start = time.perf_counter()
                _, lookup = await cache.get_or_compute(request_key("", "sim", 1, canonical), compute)
                samples.append(time.perf_counter() - start)
                if lookup != "hit":
                    raise RuntimeError(f"expected a hit, got {lookup}")
            return samples
        finally:
            await client.close()

    return quantiles(asyncio.run(run()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    n = max(1, min(args.requests, 20_000))
    port = free_port()
    redis = start_redis(port)
    url = f"redis://127.0.0.1:{port}/0"
    result: dict[str, Any] = {"requests": n, "in_process": {}}
    try:
        for items in (1, 64):
            result["in_process"][f"memory, {items} items"] = memory_in_process(n, items)
            result["in_process"][f"redis, {items} items"] = in_process(url, n, items)
        config = (
            f'[gateway]\nredis_url = "{url}"\n[models.sim]\ncache = {{ enabled = true, store = "redis" }}\n'
        )
        with InferdServer(
            "--model", "sim", "--no-admin", "--log-level", "WARNING", name="cache-hit-redis", config=config
        ) as server:
            result["http"] = over_http(server.port, n)
    finally:
        redis.kill()
        redis.wait(timeout=10)
    write_json(OUT_DIR / "cache_hit_redis.json", result)
    print("| what | p50 ms | p99 ms | mean ms |\n|---|---|---|---|")
    rows = {f"in process, hit ({k})": v for k, v in result["in_process"].items()}
    rows |= {"HTTP: OIP infer, redis cache hit": result["http"]["infer_hit"]}
    rows |= {"HTTP: GET model metadata (floor)": result["http"]["metadata_floor"]}
    for name, q in rows.items():
        print(f"| {name} | {q['p50_ms']:.3f} | {q['p99_ms']:.3f} | {q['mean_ms']:.3f} |")


if __name__ == "__main__":
    main()
