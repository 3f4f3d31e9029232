"""Locality: the share of requests served in their front end's own zone at --levels (30%, 60%, 90%) of a
zone's capacity.

The fleet is zone_cluster.py's: --zones (3) zones, each a front-end host and a worker host of --workers
`sim` workers (each joining every front end), in network namespaces, and a Redis host. A zone's capacity
is its devices' full-batch capacity (workers x max_batch / cost(max_batch)). For each level, two loads,
each inferd's open-loop generator (Poisson arrivals, every answer checked) for --warmup + --seconds:
  - every zone's clients offer the level of their zone's capacity to their own front end;
  - only the first zone's clients do (the other zones idle: room to spill into).
The share served in-zone is read from each front end's /metrics (inferd_requests_by_zone_total, the
work it sent to each zone's workers; inferd_requests_spilled_by_zone_total, what went beyond the zone
shares because its zone was short of capacity), over the measured window.

    sudo .venv/bin/python benchmarks/locality.py [--zones 3] [--workers 1] [--levels 0.3,0.6,0.9]
        [--seconds 15] [--warmup 3] [--slo-ms 500]

Writes .bench/locality.json and prints a markdown table. Exits 1 when an answer was wrong, 2 when the
fleet could not be started. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

from harness import OUT_DIR, cell, interrupt_on, write_json
from zone_cluster import SPILLED, Device, FrontEnd, ZoneFleet, by_zone, delta

from inferd.bench.load_spec import LoadSpec
from inferd.bench.loadgen import offer_load
from inferd.bench.open_loop import arrival_offsets, run_blocking
from inferd.bench.report import PhaseReport, Recorder


def step(args: argparse.Namespace, fleet: ZoneFleet, level: float, loaded: list[FrontEnd]) -> dict[str, Any]:
    """`loaded` front ends each offered `level` of a zone's capacity; what each sent to each zone."""
    zone_rps = fleet.workers_per_zone * fleet.device.capacity_rps()
    warm, measured = Recorder(), Recorder(slo_ms=args.slo_ms)
    specs = [
        LoadSpec(url=fe.url, rate=level * zone_rps, duration_s=args.seconds, warmup_s=args.warmup, seed=i + 1,
                 slo_ms=args.slo_ms, timeout_ms=5000.0, connections=512)
        for i, fe in enumerate(loaded)
    ]  # fmt: skip
    snapshots: list[tuple[dict, dict]] = []

    def snap(_: float = 0.0) -> None:
        snapshots.append(({fe.id: by_zone(fe) for fe in loaded}, {fe.id: by_zone(fe, SPILLED) for fe in loaded}))

    def recorder_for(i: int, offset: float) -> Recorder:
        return measured if offset >= args.warmup else warm

    async def main() -> None:
        async def snap_after_warmup() -> None:
            await asyncio.sleep(args.warmup)
            await asyncio.to_thread(snap)

        await asyncio.gather(snap_after_warmup(), *(offer_load(s, arrival_offsets(s), recorder_for) for s in specs))

    run_blocking(main())
    snap()
    rows = {}
    for fe in loaded:
        d = delta(snapshots[1][0][fe.id], snapshots[0][0][fe.id]) or {}
        s = delta(snapshots[1][1][fe.id], snapshots[0][1][fe.id]) or {}
        served = sum(d.values())
        zone = fe.id.removeprefix("fe-")
        rows[fe.id] = {"served": served, "in_zone": d.get(zone, 0.0) / served if served else None,
                       "spilled": sum(s.values()), "by_zone": d}  # fmt: skip
    time.sleep(2.0)  # the queues drain before the next step
    return {"level": level, "loaded": [fe.id for fe in loaded], "offered_rps": level * zone_rps * len(loaded),
            "front_ends": rows, "load": PhaseReport.from_recorder(measured, args.seconds).to_dict()}  # fmt: skip


def print_table(run: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"a zone's capacity: {run['zone_capacity_rps']:.0f} answers/s ({args.workers} sim worker(s): "
          f"{args.base_ms:g} ms + {args.per_item_ms:g} ms/item, batches of {args.max_batch}); {args.zones} zones\n")  # fmt: skip
    print("| load (of a zone's capacity) | zones loaded | offered/s | served in-zone | spilled | p50 ms | p99 ms | "
          "errors |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for r in run["steps"]:
        served = sum(f["served"] for f in r["front_ends"].values())
        local = sum((f["in_zone"] or 0.0) * f["served"] for f in r["front_ends"].values())
        spilled = sum(f["spilled"] for f in r["front_ends"].values())
        lat, errors = r["load"]["latency_ms"], r["load"]["errors"]
        err = ", ".join(f"{k}: {v}" for k, v in errors.items() if v) or "0"
        which = "all" if len(r["loaded"]) > 1 else r["loaded"][0]
        share = f"{local / served:.1%}" if served else "-"
        print(f"| {r['level']:.0%} | {which} | {r['offered_rps']:.0f} | {share} | {spilled:.0f} | "
              f"{cell(lat.get('p50'))} | {cell(lat.get('p99'))} | {err} |")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zones", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="sim workers per zone")
    ap.add_argument("--levels", default="0.3,0.6,0.9", help="shares of a zone's capacity, comma-separated")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--slo-ms", type=float, default=500.0)
    ap.add_argument("--base-ms", type=float, default=40.0)
    ap.add_argument("--per-item-ms", type=float, default=5.0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-wait-ms", type=float, default=2.0, help="the batching wait (part of the load spill's floor)")
    args = ap.parse_args()
    levels = [float(x) for x in args.levels.split(",") if x.strip()]
    if not 2 <= args.zones <= 6 or not 1 <= args.workers <= 4 or not all(0 < x <= 1.5 for x in levels):
        raise SystemExit("--zones within 2..6, --workers within 1..4, each level within (0, 1.5]")
    if args.seconds <= 0 or args.warmup < 1 or len(levels) * 2 * (args.seconds + args.warmup) > 600:
        raise SystemExit("--seconds > 0, --warmup >= 1, at most 600 s of load in all")
    interrupt_on(signal.SIGTERM, signal.SIGHUP)
    log_dir = OUT_DIR / "locality"
    log_dir.mkdir(parents=True, exist_ok=True)
    device = Device(args.base_ms, args.per_item_ms, args.max_batch, args.max_wait_ms)
    started = time.strftime("%H:%M:%S")
    try:
        with ZoneFleet(args.zones, args.workers, device, log_dir) as fleet:
            steps = []
            for level in levels:
                steps.append(step(args, fleet, level, fleet.front_ends))
                steps.append(step(args, fleet, level, fleet.front_ends[:1]))
            run = {"started": started, "args": vars(args), "steps": steps,
                   "zone_capacity_rps": args.workers * device.capacity_rps()}  # fmt: skip
    except TimeoutError as exc:
        print(f"locality: {exc}", file=sys.stderr)
        return 2
    write_json(OUT_DIR / "locality.json", run)
    print_table(run, args)
    return 1 if any(s["load"]["mismatched"] for s in run["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
