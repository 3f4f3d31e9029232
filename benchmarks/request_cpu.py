"""The server's CPU per request, the figures issue 26 holds the request path to, with the load tool on the
same machine (open-loop Poisson, every answer checked):

* CPU per request at 1,000 and 3,000 req/s: utime + stime of the server's whole process tree (the front
  end and every worker, from /proc) over the run, divided by the requests sent (warm-up included,
  since the CPU is read around the whole run);
* the tree's idle CPU (ms of CPU per second with no load), so the per-request figure can be read with
  and without it;
* p99 at 3,000 req/s;
* overload at 4,980 req/s offered (1.5x the device's 3,333): goodput against the ceiling and how fast
  the 429s come.

The server is a default `inferd serve --model sim` (the simulated device: 20 ms + 0.1 ms per item, batches
of up to 100, 10 ms wait), nothing else set.

    .venv/bin/python benchmarks/request_cpu.py [--repeats 3] [--duration 10] [--warmup 2] [--tree DIR]

`--tree DIR` serves another checkout's code (its src/ first on the server's PYTHONPATH; this venv's
packages) under this tree's load tool, so trees are compared on the same machine in the same hour.

Writes .bench/request_cpu.json and prints a markdown table; the targets are printed beside the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from harness import OUT_DIR, InferdServer, cell, free_port, port_free, write_json
from procfs import cpu_seconds_since, machine_busy_s

from inferd.bench.loadgen import LoadSpec, run_load_blocking

CEILING_RPS = 100 / 0.030
"""sim's device ceiling: 100 items per 20 + 0.1 x 100 ms batch."""
TARGETS = {"cpu_1000": 190.0, "cpu_3000": 120.0, "p99_3000": 100.0, "goodput_share": 0.95, "p99_429": 10.0}


def server_port() -> int:
    """A free port whose next two are free too (with --tree, a tree that may predate --grpc-port: its
    gRPC API, if it has one, on the HTTP port + 1, its admin API on + 1 or + 2)."""
    while True:
        port = free_port()
        if port < 65000 and port_free(port + 1) and port_free(port + 2):
            return port


def idle_cpu_ms_per_s(server: InferdServer, seconds: float) -> float:
    before = server.cpu_ticks()
    time.sleep(seconds)
    return 1000 * cpu_seconds_since(before, server.pids()) / seconds


def one_run(server: InferdServer, rate: float, args: argparse.Namespace, seed: int) -> dict:
    spec = LoadSpec(
        url=server.url,
        model="sim",
        rate=rate,
        duration_s=args.duration,
        warmup_s=args.warmup,
        timeout_ms=5000.0,
        slo_ms=args.slo_ms,
        seed=seed,
    )
    before = server.cpu_ticks()
    busy0 = machine_busy_s()
    t0 = time.monotonic()
    report = run_load_blocking(spec)
    wall = time.monotonic() - t0
    cpu_s = cpu_seconds_since(before, server.pids())
    other_s = machine_busy_s() - busy0 - cpu_s - report.generator_cpu_s
    m = report.measured
    sent = max(1, report.sent)
    return {
        "rate": rate,
        "achieved": round(m.achieved_rps, 1),
        "ok": m.ok,
        "errors": m.errors,
        "mismatched": m.mismatched,
        "p50_ms": m.latency_ms.get("p50"),
        "p99_ms": m.latency_ms.get("p99"),
        "mean_batch": m.batch_size.get("mean"),
        "ok_per_s": round(m.ok / args.duration, 1),
        "rejection_p50_ms": m.rejection_ms.get("p50"),
        "rejection_p99_ms": m.rejection_ms.get("p99"),
        "cpu_us_per_request": round(1e6 * cpu_s / sent, 1),
        "cpu_s": round(cpu_s, 3),
        "wall_s": round(wall, 2),
        "sent": report.sent,
        "generator_cpu_us_per_request": round(1e6 * report.generator_cpu_s / sent, 1),
        "other_cpu_s": round(max(0.0, other_s), 2),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--rates", default="1000,3000")
    ap.add_argument("--overload-rate", type=float, default=4980.0)
    ap.add_argument("--slo-ms", type=float, default=100.0)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--tree", default=None, help="serve this checkout's src/ instead of this tree's")
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")] + [args.overload_rate]
    out: dict = {"command": " ".join(sys.argv), "runs": []}
    env = None if args.tree is None else {"PYTHONPATH": os.path.join(os.path.abspath(args.tree), "src")}
    server = InferdServer(
        "--model", "sim", name="request_cpu", port=server_port(), ready_timeout_s=60.0, grace_s=30.0, env=env,
        free_ports=args.tree is None,
    )  # fmt: skip
    with server:
        time.sleep(1.0)  # let start-up settle before the idle reading
        out["idle_cpu_ms_per_s"] = round(idle_cpu_ms_per_s(server, args.idle_s), 2)
        for repeat in range(args.repeats):
            for rate in rates:
                out["runs"].append(one_run(server, rate, args, seed=int(rate) + repeat))
    idle = out["idle_cpu_ms_per_s"]
    print(f"idle CPU of the tree: {idle:.2f} ms per s\n")
    print(
        "| offered req/s | achieved | ok/s | p50 ms | p99 ms | errors | 429 p50 / p99 ms | mean batch "
        "| CPU us/req | less idle | load tool us/req | other CPU s | load 1m |"
    )
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["runs"]:
        errors = sum(r["errors"].values())
        less_idle = r["cpu_us_per_request"] - 1000 * idle * r["wall_s"] / max(1, r["sent"])
        print(
            f"| {r['rate']:,.0f} | {r['achieved']:,.0f} | {r['ok_per_s']:,.0f} | {cell(r['p50_ms'])} "
            f"| {cell(r['p99_ms'])} | {errors} | {cell(r['rejection_p50_ms'])} / {cell(r['rejection_p99_ms'])} "
            f"| {cell(r['mean_batch'])} "
            f"| {r['cpu_us_per_request']:.0f} | {less_idle:.0f} | {r['generator_cpu_us_per_request']:.0f} "
            f"| {r['other_cpu_s']} | {r['load_1m']} |"
        )

    def med(rate: float, key: str) -> float:
        return statistics.median(r[key] or 0 for r in out["runs"] if r["rate"] == rate)

    summary = {
        "cpu_1000": med(1000.0, "cpu_us_per_request") if 1000.0 in rates else None,
        "cpu_3000": med(3000.0, "cpu_us_per_request") if 3000.0 in rates else None,
        "p99_3000": med(3000.0, "p99_ms") if 3000.0 in rates else None,
        "goodput_share": med(args.overload_rate, "ok_per_s") / CEILING_RPS,
        "p99_429": med(args.overload_rate, "rejection_p99_ms"),
    }
    out["summary"] = summary
    print("\nmedians against the targets:")
    for key, value in summary.items():
        if value is None:
            continue
        target = TARGETS[key]
        ok = value >= target if key == "goodput_share" else value <= target
        print(f"  {key}: {value:.3g} (target {'>=' if key == 'goodput_share' else '<='} {target}) "
              f"{'met' if ok else 'MISSED'}")
    write_json(OUT_DIR / "request_cpu.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
