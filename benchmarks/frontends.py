"""Front ends: does splitting the arrivals over several front-end processes shrink the batches?

Starts `inferd serve --frontends N` itself for each N of --frontends (1 and 2), with only `sim` (base_ms = 20,
per_item_ms = 0.2, max_batch_size = 64) on --workers workers (2), and offers the same open-loop load to
each (`inferd bench --rate R`, new connections spread over the front ends by SO_REUSEPORT). Reads the
mean batch size from the server's /metrics (`inferd_batch_size`, summed over the `frontend` label)
before and after the measured window, so only its batches count, and the CPU each kind of process
spent per request sent over the whole load (warmup included), from /proc: the front ends, the workers and the parent
that supervises the front ends (with --frontends 1 the front end is the parent).

The claim: at the same load, the mean batch size with several front ends stays >= 80% of one front
end's (each worker grants its staged slot to the front end whose oldest item has waited longest, so each
front end's batch carries what arrived while the others' ran).

    python benchmarks/frontends.py [--rate 1500] [--duration 10] [--warmup 2] [--frontends 1,2]

Exits 1 when an answer was misrouted or duplicated, 2 when a server could not be started.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from harness import OUT_DIR, InferdServer, ServerNotReady, cell, inferd_command, interrupt_on, write_json
from procfs import CLK_TCK

CONFIG = """\
[models.sim]
max_batch_size = 64
max_queue_size = 512

[models.sim.params]
base_ms = 20.0
per_item_ms = 0.2
"""


def batch_totals(url: str) -> tuple[float, float]:
    """(batches, items) cut so far, over every front end."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith("inferd_batch_size_count{"):
            count += float(line.rpartition(" ")[2])
        elif line.startswith("inferd_batch_size_sum{"):
            total += float(line.rpartition(" ")[2])
    return count, total


def role(pid: int, root: int, frontends: int) -> str:
    """The process's part: worker, parent or front end (the parent is the front end when alone)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    if b"inferd.worker" in cmdline:
        return "worker"
    return "parent" if pid == root and frontends > 1 else "front end"


def cpu_by_role(server: InferdServer, before: dict[int, int], frontends: int) -> dict[str, float]:
    """CPU seconds per role since `before` (a process that appeared since counts whole)."""
    out: dict[str, float] = {}
    for pid, ticks in server.cpu_ticks().items():
        r = role(pid, server.pid, frontends)
        out[r] = out.get(r, 0.0) + (ticks - before.get(pid, 0)) / CLK_TCK
    return out


def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = inferd_command(
        "bench", "--url", url, "--rate", str(args.rate), "--duration", str(args.duration),
        "--warmup", str(args.warmup), "--timeout-ms", "5000", "--connections", "256",
        "--seed", "7", "--json",
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, timeout=args.warmup + args.duration + 60, check=False)
    if not proc.stdout.strip():
        raise RuntimeError(f"bench printed nothing: {proc.stderr.decode()[-2000:]}")
    return json.loads(proc.stdout)


def run(frontends: int, args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    server = InferdServer(
        "--model", "sim", "--no-admin", "--log-level", "WARNING", "--workers", str(args.workers),
        "--frontends", str(frontends), name=f"frontends_{frontends}", config=CONFIG, log_path=log_path,
    )  # fmt: skip
    with server:
        before = batch_totals(server.url)
        ticks = server.cpu_ticks()
        report = bench(server.url, args)
        cpu = cpu_by_role(server, ticks, frontends)
        after = batch_totals(server.url)
    batches, items = after[0] - before[0], after[1] - before[1]
    m = report["measured"]
    return {
        "frontends": frontends,
        "offered_rps": m["offered_rps"],
        "achieved_rps": m["achieved_rps"],
        "ok": m["ok"],
        "errors": {k: v for k, v in m["errors"].items() if v},
        "latency_ms": m["latency_ms"],
        "batches": batches,
        "mean_batch_size": items / batches if batches else None,
        "mismatched": report["mismatched_total"],
        "cpu_us_per_request": {r: 1e6 * s / max(1, report["sent"]) for r, s in sorted(cpu.items())},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rate", type=float, default=1500.0, help="offered req/s, the same for both runs")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of each measured window")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before it")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--frontends", default="1,2", help="front ends of each run; the first is the base")
    parser.add_argument("--json-out", type=Path, default=OUT_DIR / "frontends.json")
    args = parser.parse_args()
    interrupt_on(signal.SIGTERM)
    log_path = args.json_out.with_name("frontends_server.log")
    runs = []
    for n in (int(x) for x in args.frontends.split(",")):
        try:
            runs.append(run(n, args, log_path))
        except ServerNotReady as exc:
            print(f"error: {exc}")
            return 2
    print(
        "| front ends | offered req/s | ok req/s | errors | p50 ms | p99 ms | batches | mean batch size "
        "| CPU us/req: front ends | workers | parent |"
    )
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        lat, us = r["latency_ms"], r["cpu_us_per_request"]
        print(
            f"| {r['frontends']} | {cell(r['offered_rps'], 0)} | {cell(r['achieved_rps'])} | "
            f"{r['errors'] or '-'} | {cell(lat.get('p50'))} | {cell(lat.get('p99'))} | "
            f"{r['batches']:,.0f} | {cell(r['mean_batch_size'], 1)} | {cell(us.get('front end'), 0)} | "
            f"{cell(us.get('worker'), 0)} | {cell(us.get('parent'), 0)} |"
        )
    base = runs[0]
    ratios = {}
    for r in runs[1:]:
        one, more = base["mean_batch_size"], r["mean_batch_size"]
        ratios[r["frontends"]] = ratio = more / one if one and more else None
        print(f"\nmean batch size, {r['frontends']} front ends / {base['frontends']}: {cell(ratio, 2)} (claim: >= 0.80)")
    ratio = next(iter(ratios.values()), None)
    write_json(args.json_out, {"runs": runs, "ratio": ratio, "ratios": ratios, "args": vars(args) | {"json_out": ""}})
    return 1 if any(r["mismatched"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
