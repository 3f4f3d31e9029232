"""The gRPC edge against REST on one server: `sim` through Triton's ModelInfer (raw_input_contents over
grpc.aio channels) and through OIP v2 JSON (the raw HTTP/1.1 client), the same open-loop load tool and
the same answer check (the sim digest), on the same default `inferd serve --model sim`.

1. CPU per request at equal rates (`--cpu-rates`, default 1,000 and 2,000 req/s), the protocols
   alternating, `--repeats` times: utime + stime of the front-end process (the `inferd serve` process,
   where both edges run; /proc/PID/stat, every thread counted) over each run, divided by the requests
   sent (warm-up included, as the CPU is read around the whole run), and the whole tree's (front end and
   worker) beside it. The issue's goal: gRPC's front-end CPU per request <= 1.25x REST's.
2. The highest rate held: a short sweep (`--sweep`, each step `--step-duration` s after `--warmup` s),
   per protocol, stopping at its first step that fails: held means p99 <= `--p99-ms`, no errors, no
   wrong answer, and at least 95% of the offered rate answered ok.
3. The floors (`--floor`, the default): at the first CPU rate, the same load against a bare grpc.aio
   ModelInfer handler and a bare httptools protocol answering the sim digest (`benchmarks/http_floor.py
   --server grpc|httptools`, each its own process): what grpcio and HTTP parsing cost per request alone,
   under the edge's and the front door's figures.
4. Overload (`--overload-rate`, default 4,000 req/s, past sim's 3,333 ceiling; 0: skip), one step per
   protocol: ok/s, errors by kind, and how many of the requests the server's own request counter
   (`inferd_requests_total` of that protocol, from /metrics) saw: a refusal the server makes is counted
   there, one that never reaches inferd is not.

The load tool runs in this process, on the same cores as the server; its own CPU per request is printed
for each run (grpc.aio's client costs more than the raw HTTP client: on a machine where the tool and the
server share two cores, that caps the gRPC sweep before the server does). Bounded: at most
len(cpu_rates) x 2 x repeats + 2 x (len(sweep) + 1) runs of warmup + duration seconds, plus the
server's start.

    .venv/bin/python benchmarks/grpc_vs_rest.py [--repeats 2] [--duration 8] [--sweep 500,1000,...]

Prints a markdown table per part, then one JSON line (also in .bench/grpc_vs_rest.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import urllib.request

import grpc
from harness import (
    OUT_DIR,
    InferdServer,
    ServerProcess,
    cell,
    free_port,
    http_ok,
    interrupt_on,
    port_free,
    write_json,
)
from procfs import CLK_TCK, cpu_seconds_since, cpu_ticks, machine_busy_s

from inferd.bench.loadgen import LoadSpec, run_load_blocking

PROTOCOLS = ("http", "grpc")
GOAL_RATIO = 1.25


def server_ports() -> tuple[int, int]:
    """An HTTP port whose admin port (+2) is free, and a free gRPC port."""
    while True:
        port = free_port()
        if port < 65000 and port_free(port + 1) and port_free(port + 2):
            return port, port + 1


def wait_grpc(target: str, timeout_s: float) -> None:
    channel = grpc.insecure_channel(target)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    finally:
        channel.close()


def one_run(server: InferdServer, target: str, protocol: str, rate: float, duration: float,
            warmup: float, args: argparse.Namespace, seed: int) -> dict:  # fmt: skip
    spec = LoadSpec(
        url=server.url if protocol == "http" else target,
        protocol=protocol,  # type: ignore[arg-type]
        channels=args.channels,
        model="sim",
        rate=rate,
        duration_s=duration,
        warmup_s=warmup,
        timeout_ms=5000.0,
        slo_ms=args.p99_ms,
        seed=seed,
    )
    front = server.pid
    before = server.cpu_ticks()
    busy0 = machine_busy_s()
    t0 = time.monotonic()
    report = run_load_blocking(spec)
    wall = time.monotonic() - t0
    after = cpu_ticks(server.pids())
    tree_s = cpu_seconds_since(before, after.keys())
    front_s = (after.get(front, 0) - before.get(front, 0)) / CLK_TCK
    other_s = machine_busy_s() - busy0 - tree_s - report.generator_cpu_s
    m = report.measured
    sent = max(1, report.sent)
    return {
        "protocol": protocol,
        "rate": rate,
        "achieved": round(m.achieved_rps, 1),
        "ok": m.ok,
        "sent_measured": m.sent,
        "errors": m.errors,
        "mismatched": report.mismatched_total,
        "p50_ms": m.latency_ms.get("p50"),
        "p99_ms": m.latency_ms.get("p99"),
        "goodput_rps": m.goodput_rps,
        "mean_batch": m.batch_size.get("mean"),
        "frontend_cpu_us_per_request": round(1e6 * front_s / sent, 1),
        "tree_cpu_us_per_request": round(1e6 * tree_s / sent, 1),
        "generator_cpu_us_per_request": round(1e6 * report.generator_cpu_s / sent, 1),
        "sent": report.sent,
        "wall_s": round(wall, 2),
        "other_cpu_s": round(max(0.0, other_s), 2),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def floor_run(kind: str, rate: float, args: argparse.Namespace) -> dict:
    """`benchmarks/http_floor.py --server KIND` in its own process under the same load: its CPU per request."""
    port = free_port()
    while not port_free(port + 1):
        port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "http_floor.py"), "--server", kind, "--serve-port", str(port)]
    floor = ServerProcess(cmd, name=f"floor-{kind}", log_path=OUT_DIR / f"grpc_vs_rest.floor-{kind}.log")
    with floor:
        deadline = time.monotonic() + 30.0
        while not http_ok(f"http://127.0.0.1:{port}/v2/health/ready") and time.monotonic() < deadline:
            time.sleep(0.1)
        if kind == "grpc":
            wait_grpc(f"127.0.0.1:{port + 1}", 30.0)
        spec = LoadSpec(
            url=f"127.0.0.1:{port + 1}" if kind == "grpc" else f"http://127.0.0.1:{port}",
            protocol="grpc" if kind == "grpc" else "http", channels=args.channels, model="sim", rate=rate,
            duration_s=args.duration, warmup_s=args.warmup, timeout_ms=5000.0, seed=7,
        )  # fmt: skip
        before = floor.cpu_ticks()
        report = run_load_blocking(spec)
        cpu_s = cpu_seconds_since(before, floor.pids())
    m = report.measured
    sent = max(1, report.sent)
    return {
        "server": f"bare {kind}",
        "rate": rate,
        "achieved": round(m.achieved_rps, 1),
        "errors": m.errors,
        "mismatched": report.mismatched_total,
        "p99_ms": m.latency_ms.get("p99"),
        "server_cpu_us_per_request": round(1e6 * cpu_s / sent, 1),
        "generator_cpu_us_per_request": round(1e6 * report.generator_cpu_s / sent, 1),
    }


def requests_counted(url: str, protocol: str) -> int:
    """The server's inferd_requests_total over every model and outcome, for one protocol."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    label = f'protocol="{protocol}"'
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("inferd_requests_total{") and label in line))  # fmt: skip


def held(r: dict, p99_ms: float) -> bool:
    """The step held: p99 within the bound, no error, no wrong answer, >= 95% of the offered rate ok."""
    return (
        r["p99_ms"] is not None
        and r["p99_ms"] <= p99_ms
        and not r["errors"]
        and r["mismatched"] == 0
        and r["ok"] >= 0.95 * r["sent_measured"]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-rates", default="1000,2000")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of each CPU run")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--sweep", default="500,1000,1500,2000,2500,3000")
    ap.add_argument("--step-duration", type=float, default=5.0)
    ap.add_argument("--p99-ms", type=float, default=100.0)
    ap.add_argument("--overload-rate", type=float, default=4000.0)
    ap.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--channels", type=int, default=4, help="gRPC channels of the load tool")
    ap.add_argument("--protocols", default="http,grpc")
    ap.add_argument("--tree", default=None, help="serve this checkout's src/ instead of this tree's")
    args = ap.parse_args()
    interrupt_on(signal.SIGTERM)
    protocols = [p for p in args.protocols.split(",") if p in PROTOCOLS]
    cpu_rates = [float(x) for x in args.cpu_rates.split(",") if x]
    sweep = [float(x) for x in args.sweep.split(",") if x]
    env = None if args.tree is None else {"PYTHONPATH": os.path.join(os.path.abspath(args.tree), "src")}
    http_port, grpc_port = server_ports()
    target = f"127.0.0.1:{grpc_port}"
    out: dict = {
        "command": " ".join(sys.argv),
        "cpu_runs": [],
        "sweep": {p: [] for p in protocols},
        "overload": [],
        "floors": [],
    }
    server = InferdServer(
        "--model", "sim", "--grpc-port", str(grpc_port), name="grpc_vs_rest", port=http_port,
        log_path=OUT_DIR / "grpc_vs_rest.server.log", ready_timeout_s=60.0, grace_s=30.0, env=env,
    )  # fmt: skip
    t_start = time.monotonic()
    with server:
        if "grpc" in protocols:
            wait_grpc(target, 30.0)
        time.sleep(1.0)
        seed = 0
        for repeat in range(args.repeats):
            for rate in cpu_rates:
                order = protocols if repeat % 2 == 0 else protocols[::-1]
                for protocol in order:
                    seed += 1
                    run = one_run(server, target, protocol, rate, args.duration, args.warmup, args, seed)
                    out["cpu_runs"].append(run)
                    print(f"  cpu {protocol} {rate:g}: front end {run['frontend_cpu_us_per_request']} us/req, "
                          f"p99 {cell(run['p99_ms'])} ms", file=sys.stderr)  # fmt: skip
        for protocol in protocols:
            for rate in sweep:
                seed += 1
                run = one_run(server, target, protocol, rate, args.step_duration, args.warmup, args, seed)
                run["held"] = held(run, args.p99_ms)
                out["sweep"][protocol].append(run)
                print(
                    f"  sweep {protocol} {rate:g}: p99 {cell(run['p99_ms'])} ms, held {run['held']}",
                    file=sys.stderr,
                )
                if not run["held"]:
                    break
        for protocol in protocols if args.overload_rate > 0 else ():
            seed += 1
            counted0 = requests_counted(server.url, protocol)
            run = one_run(
                server, target, protocol, args.overload_rate, args.step_duration, args.warmup, args, seed
            )
            run["counted_by_server"] = requests_counted(server.url, protocol) - counted0
            out["overload"].append(run)
    if args.floor and cpu_rates:
        for kind in ("grpc", "httptools"):
            out["floors"].append(floor_run(kind, cpu_rates[0], args))
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    out["server_stopped"] = server.stopped.how if server.stopped else None

    print("\nCPU per request at equal rates (front end = the `inferd serve` process; tree = + its worker)\n")
    print("| protocol | offered req/s | achieved | p50 ms | p99 ms | errors | front end us/req | tree us/req "
          "| load tool us/req | other CPU s | load 1m |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in out["cpu_runs"]:
        print(
            f"| {r['protocol']} | {r['rate']:,.0f} | {r['achieved']:,.0f} | {cell(r['p50_ms'])} | {cell(r['p99_ms'])} "
            f"| {sum(r['errors'].values())} | {r['frontend_cpu_us_per_request']:.0f} | {r['tree_cpu_us_per_request']:.0f} "
            f"| {r['generator_cpu_us_per_request']:.0f} | {r['other_cpu_s']} | {r['load_1m']} |"
        )
    summary: dict = {"cpu": {}, "highest_held_rps": {}}
    for rate in cpu_rates:
        med = {
            p: statistics.median(
                r["frontend_cpu_us_per_request"]
                for r in out["cpu_runs"]
                if r["protocol"] == p and r["rate"] == rate
            )
            for p in protocols
        }
        entry = {f"{p}_frontend_us": round(med[p], 1) for p in protocols}
        if set(protocols) == set(PROTOCOLS):
            entry["ratio"] = round(med["grpc"] / med["http"], 3)
            entry["goal_met"] = entry["ratio"] <= GOAL_RATIO
        summary["cpu"][f"{rate:g}"] = entry
    print(f"\nThe rate held (p99 <= {args.p99_ms:g} ms, no errors, >= 95% ok), sweep {args.sweep}\n")
    print(
        "| protocol | offered req/s | achieved | p50 ms | p99 ms | errors | held | load tool us/req | load 1m |"
    )
    print("|---|---:|---:|---:|---:|---|---|---:|---:|")
    for protocol in protocols:
        runs = out["sweep"][protocol]
        for r in runs:
            print(
                f"| {protocol} | {r['rate']:,.0f} | {r['achieved']:,.0f} | {cell(r['p50_ms'])} | {cell(r['p99_ms'])} "
                f"| {r['errors'] or '-'} | {'yes' if r['held'] else 'no'} | {r['generator_cpu_us_per_request']:.0f} "
                f"| {r['load_1m']} |"
            )
        held_rates = [r["rate"] for r in runs if r["held"]]
        summary["highest_held_rps"][protocol] = max(held_rates) if held_rates else None
    if out["floors"]:
        print(f"\nFloors at {cpu_rates[0]:,.0f} req/s: a bare server answering the sim digest (no inferd)\n")
        print("| server | achieved | p99 ms | errors | server us/req | load tool us/req |")
        print("|---|---:|---:|---|---:|---:|")
        for r in out["floors"]:
            print(
                f"| {r['server']} | {r['achieved']:,.0f} | {cell(r['p99_ms'])} | {r['errors'] or '-'} "
                f"| {r['server_cpu_us_per_request']:.0f} | {r['generator_cpu_us_per_request']:.0f} |"
            )
        summary["floors_us"] = {r["server"]: r["server_cpu_us_per_request"] for r in out["floors"]}
    if out["overload"]:
        print(f"\nOverload: {args.overload_rate:,.0f} req/s offered (sim's ceiling ~3,333)\n")
        print("| protocol | sent | ok/s | p99 ms | errors | counted by the server | load tool us/req |")
        print("|---|---:|---:|---:|---|---:|---:|")
        for r in out["overload"]:
            print(
                f"| {r['protocol']} | {r['sent']:,} | {r['achieved']:,.0f} | {cell(r['p99_ms'])} | {r['errors'] or '-'} "
                f"| {r['counted_by_server']:,} | {r['generator_cpu_us_per_request']:.0f} |"
            )
        summary["overload"] = {
            r["protocol"]: {"ok_per_s": r["achieved"], "errors": r["errors"], "counted_by_server": r["counted_by_server"],
                            "sent": r["sent"]}
            for r in out["overload"]
        }  # fmt: skip
    out["summary"] = summary
    print("\nmedians of the front end's CPU per request, gRPC / REST (goal <= 1.25):")
    for rate, entry in summary["cpu"].items():
        print(f"  {rate} req/s: {json.dumps(entry)}")
    print(f"highest rate held: {json.dumps(summary['highest_held_rps'])}")
    write_json(OUT_DIR / "grpc_vs_rest.json", out)
    print(json.dumps({"summary": summary, "wall_s": out["wall_s"], "command": out["command"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
