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
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from inferd.bench.loadgen import LoadSpec, run_load_blocking

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def proc_tree(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    )
    return [pid] + [int(x) for x in out.stdout.split()]


def cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except FileNotFoundError:
            pass
    return total / TICK


def rss_mib(pids: list[int]) -> dict[str, float]:
    out = {}
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[str(pid)] = round(int(line.split()[1]) / 1024, 1)
        except FileNotFoundError:
            pass
    return out


def start_server(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            str(ROOT / ".venv" / "bin" / "inferd"),
            "serve",
            "--model",
            "sim",
            "--port",
            str(port),
            "--no-admin",
            "--log-level",
            "WARNING",
        ],
        cwd=ROOT,
    )
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not become ready")


def run(
    url: str, rate: float, duration: float, warmup: float, pids: list[int], slo_ms: float | None = None
) -> dict:
    spec = LoadSpec(
        url=url,
        model="sim",
        rate=rate,
        duration_s=duration,
        warmup_s=warmup,
        timeout_ms=5000.0,
        slo_ms=slo_ms,
        seed=int(rate),
    )
    c0 = cpu_s(pids)
    report = run_load_blocking(spec)
    c1 = cpu_s(pids)
    m = report.measured
    served = m.ok + sum(m.errors.values())
    total_sent = report.sent
    return {
        "offered": round(m.offered_rps, 1),
        "achieved": round(m.achieved_rps, 1),
        "ok": m.ok,
        "errors": m.errors,
        "mismatched": m.mismatched,
        "latency_ms": m.latency_ms,
        "overhead_ms": m.overhead_ms,
        "queue_ms": m.queue_ms,
        "compute_ms": m.compute_ms,
        "batch_size": m.batch_size,
        "goodput_rps": m.goodput_rps,
        "rejection_ms": m.rejection_ms,
        "server_cpu_us_per_request": round(1e6 * (c1 - c0) / max(1, total_sent), 1),
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
    url = f"http://127.0.0.1:{args.port}"
    server = start_server(args.port)
    results: dict = {"ladder": {}, "command": " ".join(sys.argv)}
    try:
        pids = proc_tree(server.pid)
        results["low_rate"] = run(url, args.low_rate, args.duration, 1.0, pids)
        for rate in [float(x) for x in args.rates.split(",")]:
            runs = [run(url, rate, args.duration, args.warmup, pids) for _ in range(args.repeats)]
            results["ladder"][str(rate)] = runs
        results["overload"] = run(
            url, args.overload_rate, args.duration, args.warmup, pids, slo_ms=args.slo_ms
        )
        results["rss_mib"] = rss_mib(pids)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
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
    out = ROOT / ".bench" / "sim_server.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
