"""Part 1 figures for `sim` at its defaults (20 ms + 0.1 ms per item, batch 100, wait 10 ms), with the load
generator on the same machine as the server:

* sustained rate: the highest offered rate (open-loop Poisson) with no errors, >= 90% achieved and
  p99 <= --slo-ms, each rate run --repeats times (medians);
* overload: goodput and fast 429s at --overload-rate;
* framework overhead at --low-rate (latency - queue wait - compute);
* server CPU per request (server and worker processes, from /proc) and RSS.

    .venv/bin/python benchmarks/sim_server.py [--rates 2000,2500,3000,3200] [--repeats 3]

Writes .bench/sim_server.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from harness import OUT_DIR, InferdServer, run_fields, write_json
from procfs import cpu_seconds_since, rss_mib_by_pid

from inferd.bench.loadgen import LoadSpec, run_load_blocking


def run(
    server: InferdServer, rate: float, duration: float, warmup: float, slo_ms: float | None = None
) -> dict:
    spec = LoadSpec(
        url=server.url,
        model="sim",
        rate=rate,
        duration_s=duration,
        warmup_s=warmup,
        timeout_ms=5000.0,
        slo_ms=slo_ms,
        seed=int(rate),
    )
    before = server.cpu_ticks()
    report = run_load_blocking(spec)
    server_cpu_s = cpu_seconds_since(before, server.pids())
    m = report.measured
    served = m.ok + sum(m.errors.values())
    total_sent = report.sent
    return {
        "offered": round(m.offered_rps, 1),
        "achieved": round(m.achieved_rps, 1),
        **run_fields(m, "goodput_rps", "rejection_ms"),
        "server_cpu_us_per_request": round(1e6 * server_cpu_s / max(1, total_sent), 1),
        "generator_cpu_us_per_request": round(1e6 * report.generator_cpu_s / max(1, total_sent), 1),
        "served": served,
    }


def sustained(r: dict, slo_ms: float) -> bool:
    p99 = r["latency_ms"].get("p99")
    return (
        not r["errors"]
        and not r["mismatched"]
        and r["achieved"] >= 0.9 * r["offered"]
        and p99 is not None
        and p99 <= slo_ms
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="2000,2500,3000,3200")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--slo-ms", type=float, default=100.0)
    ap.add_argument("--overload-rate", type=float, default=5000.0)
    ap.add_argument("--low-rate", type=float, default=20.0)
    ap.add_argument("--port", type=int, default=8390)
    args = ap.parse_args()
    results: dict = {"ladder": {}, "command": " ".join(sys.argv)}
    serve = ("--model", "sim", "--no-admin", "--log-level", "WARNING")
    with InferdServer(
        *serve, name="sim_server", port=args.port, ready_timeout_s=30.0, grace_s=30.0
    ) as server:
        results["low_rate"] = run(server, args.low_rate, args.duration, 1.0)
        for rate in [float(x) for x in args.rates.split(",")]:
            runs = [run(server, rate, args.duration, args.warmup) for _ in range(args.repeats)]
            results["ladder"][str(rate)] = runs
        results["overload"] = run(server, args.overload_rate, args.duration, args.warmup, slo_ms=args.slo_ms)
        results["rss_mib"] = {
            str(pid): round(mib, 1) for pid, mib in rss_mib_by_pid(sorted(server.pids())).items()
        }
    best = 0.0
    print("| offered req/s | achieved (median) | p50 ms | p99 ms | errors | server CPU us/req | mean batch |")
    print("|---|---|---|---|---|---|---|")
    for rate, runs in results["ladder"].items():

        def med(key: str, sub: str | None = None, runs: list[dict] = runs) -> float:
            return statistics.median((r[key][sub] if sub else r[key]) or 0 for r in runs)

        ok_runs = sum(sustained(r, args.slo_ms) for r in runs)
        if ok_runs * 2 > len(runs):
            best = max(best, float(rate))
        errs = sum(sum(r["errors"].values()) for r in runs)
        print(
            f"| {float(rate):.0f} | {med('achieved'):.0f} | {med('latency_ms', 'p50'):.1f} | "
            f"{med('latency_ms', 'p99'):.1f} | {errs} | {med('server_cpu_us_per_request'):.0f} | "
            f"{med('batch_size', 'mean'):.1f} |"
        )
    o, low = results["overload"], results["low_rate"]
    results["sustained_rps"] = best
    print(
        f"\nsustained (p99 <= {args.slo_ms:.0f} ms, no errors, >= 90% achieved, majority of repeats): {best:.0f} req/s"
    )
    print(
        f"overload {o['offered']:.0f} req/s offered: {o['ok'] / args.duration:.0f} ok/s, goodput under SLO "
        f"{o['goodput_rps']}, errors {o['errors']}, ok p50/p99 {o['latency_ms'].get('p50')}/"
        f"{o['latency_ms'].get('p99')} ms, 429 answered in p50/p99 {o['rejection_ms'].get('p50')}/"
        f"{o['rejection_ms'].get('p99')} ms"
    )
    print(
        f"low rate {low['offered']:.0f} req/s: latency p50 {low['latency_ms'].get('p50')} ms, overhead p50 "
        f"{low['overhead_ms'].get('p50')} ms p99 {low['overhead_ms'].get('p99')} ms"
    )
    print(f"RSS MiB (server, worker): {results['rss_mib']}")
    write_json(OUT_DIR / "sim_server.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
