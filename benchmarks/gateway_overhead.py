"""What the gateway adds to a request: API key check + quota admission and release + response cache
lookup (a miss), against the same server with no tenants and no cache.

1. Over HTTP, open-loop Poisson at --rate (1,000 req/s) on `sim`, two servers up side by side:
   (a) gateway off: no tenants, cache off;
   (b) gateway on: one tenant with a key and a requests_per_s limit far above the rate (never
       refuses), sim at `cache = { enabled = true }`, every request a unique input (so each one pays
       the key check, the quota round trip and the cache lookup, and is a miss).
   Runs are interleaved a, b, a, b, ... (--repeats each) so both see the same machine load; the
   median of the runs' p50 and p99 is reported, of the latency and of the server overhead (latency -
   queue wait - compute, which leaves out sim's batching).
2. In process: the per-request CPU of each step (key check, quota admit + release, cache key + lookup),
   the floor of what (b) adds.

    .venv/bin/python benchmarks/gateway_overhead.py [--rate 1000] [--duration 12] [--repeats 3]

The load is what `inferd bench --rate 1000 --header "Authorization: Bearer KEY"` offers (the same
LoadSpec). Writes .bench/gateway_overhead.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from harness import OUT_DIR, InferdServer, interrupt_on, run_fields, write_json
from procfs import cpu_seconds_since, cpu_ticks

from inferd.bench.loadgen import LoadSpec, run_load_blocking
from inferd.clock import MonotonicClock
from inferd.config.cache import CacheConfig
from inferd.config.tenants import TenantConfig
from inferd.core.tenant import Tenant
from inferd.gateway.cache import ResponseCache, request_key
from inferd.gateway.keys import KeyDirectory, key_digest, new_key
from inferd.gateway.quota_store import InProcessStore, QuotaSettings, TenantQuotas

KEY = new_key()
LIMIT = TenantConfig(api_key_sha256=(key_digest(KEY),), requests_per_s=1_000_000.0, burst=1_000_000)
GATEWAY_ON = f"""
[models.sim]
cache = {{ enabled = true }}

[tenants.bench]
api_key_sha256 = ["{key_digest(KEY)}"]
requests_per_s = {LIMIT.requests_per_s}
burst = {LIMIT.burst}
"""


def run(
    server: InferdServer, args: argparse.Namespace, seed: int, headers: tuple[tuple[str, str], ...]
) -> dict:
    spec = LoadSpec(
        url=server.url,
        model="sim",
        rate=args.rate,
        duration_s=args.duration,
        warmup_s=args.warmup,
        timeout_ms=5000.0,
        seed=seed,  # request ids and payloads differ between runs: no run hits another's answers
        headers=headers,
    )
    before = cpu_ticks({server.pid})
    report = run_load_blocking(spec)
    front_end_s = cpu_seconds_since(before, {server.pid})
    m = report.measured
    return {
        "achieved": round(m.achieved_rps, 1),
        "front_end_cpu_us_per_request": round(1e6 * front_end_s / max(1, report.sent), 1),
        "load_average_1m": os.getloadavg()[0],
        **run_fields(m),
    }


def probe(server: InferdServer, key: str | None) -> tuple[int, str | None]:
    """One infer of a fresh input: (status, X-Inferd-Cache)."""
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [new_key()]}]}
    )
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(f"{server.url}/v2/models/sim/infer", body.encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("x-inferd-cache")
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("x-inferd-cache")


def check_setup(off: InferdServer, on: InferdServer) -> None:
    """(a) answers without a key and without the cache; (b) refuses a missing key and misses with one."""
    found = (probe(off, None), probe(on, None), probe(on, KEY))
    if found != ((200, None), (401, None), (200, "miss")):
        raise RuntimeError(f"unexpected setup (off no key, on no key, on with key): {found}")


def over_http(args: argparse.Namespace) -> dict[str, list[dict]]:
    serve = ("--model", "sim", "--no-admin", "--log-level", "WARNING")
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with (
        InferdServer(*serve, name="gateway-off", ready_timeout_s=60.0) as off,
        InferdServer(*serve, name="gateway-on", config=GATEWAY_ON, ready_timeout_s=60.0) as on,
    ):
        check_setup(off, on)
        for i in range(args.repeats):
            runs["off"].append(run(off, args, seed=100 + i, headers=()))
            runs["on"].append(run(on, args, seed=200 + i, headers=(("Authorization", f"Bearer {KEY}"),)))
            print(f"repeat {i + 1}: off {summary(runs['off'][-1])}; on {summary(runs['on'][-1])}", flush=True)
    return runs


def summary(r: dict) -> str:
    return (
        f"{r['achieved']:.0f} ok/s, errors {sum(r['errors'].values())}, latency p50/p99 "
        f"{r['latency_ms']['p50']:.2f}/{r['latency_ms']['p99']:.2f} ms, overhead p50/p99 "
        f"{r['overhead_ms']['p50']:.2f}/{r['overhead_ms']['p99']:.2f} ms, front end CPU "
        f"{r['front_end_cpu_us_per_request']:.0f} us/req, load average {r['load_average_1m']:.1f}"
    )


def median(runs: list[dict], field: str, q: str) -> float:
    return statistics.median(r[field][q] for r in runs)


def cpu(runs: list[dict]) -> float:
    return statistics.median(r["front_end_cpu_us_per_request"] for r in runs)


def per_call_us(n: int, step: Any) -> float:
    """Median of 5 batches of `n` calls of the coroutine function `step`, in us per call."""

    async def batches() -> list[float]:
        out = []
        for _ in range(5):
            start = time.perf_counter()
            for i in range(n):
                await step(i)
            out.append((time.perf_counter() - start) / n * 1e6)
        return out

    return statistics.median(asyncio.run(batches()))


def in_process(n: int) -> dict[str, float]:
    clock = MonotonicClock()
    directory = KeyDirectory({"bench": LIMIT}, time.time)
    quotas = TenantQuotas(InProcessStore(clock), QuotaSettings(), clock)
    tenant = Tenant("bench", LIMIT)
    cache: Any = ResponseCache(CacheConfig(enabled=True), clock)
    canonical = ("oip", [b"x" * 32], ["OUTPUT0"])

    async def check(i: int) -> None:
        directory.check(KEY)

    async def quota(i: int) -> None:
        decision = await quotas.admit(tenant)
        if decision.grant is not None:
            await quotas.release(tenant, decision.grant)

    async def lookup(i: int) -> None:
        cache.lookup(request_key("bench", "sim", 1, (canonical, i)))

    return {
        "key_check_us": per_call_us(n, check),
        "quota_admit_release_us": per_call_us(n, quota),
        "cache_key_and_lookup_us": per_call_us(n, lookup),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--duration", type=float, default=12.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20_000, help="In-process calls per batch.")
    args = ap.parse_args()
    interrupt_on(signal.SIGTERM)
    steps = in_process(args.calls)
    runs = over_http(args)
    result: dict[str, Any] = {"command": " ".join(sys.argv), "in_process": steps, "runs": runs}
    print(
        "\n| | latency p50 ms | latency p99 ms | overhead p50 ms | overhead p99 ms | front end CPU us/req | errors |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, label in (("off", "(a) gateway off"), ("on", "(b) key + quota + cache miss")):
        r = runs[name]
        errors = sum(sum(x["errors"].values()) for x in r)
        print(
            f"| {label} | {median(r, 'latency_ms', 'p50'):.2f} | {median(r, 'latency_ms', 'p99'):.2f} | "
            f"{median(r, 'overhead_ms', 'p50'):.2f} | {median(r, 'overhead_ms', 'p99'):.2f} | "
            f"{cpu(r):.0f} | {errors} |"
        )
    added = {
        f"{field}_{q}": round(median(runs["on"], field, q) - median(runs["off"], field, q), 3)
        for field in ("latency_ms", "overhead_ms")
        for q in ("p50", "p99")
    }
    added["front_end_cpu_us_per_request"] = round(cpu(runs["on"]) - cpu(runs["off"]), 1)
    result["added"] = added
    print(
        f"| added (b - a) | {added['latency_ms_p50']:+.2f} | {added['latency_ms_p99']:+.2f} | "
        f"{added['overhead_ms_p50']:+.2f} | {added['overhead_ms_p99']:+.2f} | "
        f"{added['front_end_cpu_us_per_request']:+.0f} | |"
    )
    print("\nin process, us per request: " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    write_json(OUT_DIR / "gateway_overhead.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
