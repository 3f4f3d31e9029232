"""Front ends sharing credited devices, in the fleet simulator: does routed throughput scale with the
number of front ends, and do batches keep their size when the same load is split over front ends?

Every run is `inferd fleet-sim run` (fleetsim/batch_fleet.py): each front end is inferd's own
ModelRuntime (its queue, batch policy, routing), every device serves every front end and grants batch
slots with the worker's own CreditLedger (1 running + 1 staged batch in total, across the front ends).
The device is `sim`'s validation device (100 ms + 1 ms per item, max batch 100, max wait 10 ms: 500
req/s per device at full batches) and each front end spends --frontend-us of CPU per request.

1. Scaling: N front ends and --per-frontend devices each (2: N = 64 is 128 devices), offered
   LOAD x the devices' capacity (Poisson), for each N of --ns and each LOAD of --loads. "Answered" is
   the routed throughput: ok answers leaving the front ends per second between the warmup and the last
   arrival (past saturation, what the devices got through, not what the queues admitted); "scale" is it
   over N times one front end's at the same load (the aim: >= 0.8 up to the devices' saturation). Each N runs --seconds of virtual time (the larger N, the fewer: the simulator's cost per
   request grows with the mesh, since every worker tells every front end).
2. Batch size: the same arrivals on --batch-devices devices behind 1 and behind 3 front ends (--batch-fe),
   at each LOAD of --batch-loads; the ratio of mean batch sizes, per batch (items / batches, what the
   server's inferd_batch_size histogram gives) and as answers see it (the mean over answers of their
   batch's size, what `inferd bench` reports).

    .venv/bin/python benchmarks/frontends_scaling.py [--ns 1,4,16,64] [--seconds 10,10,6,3]
        [--loads 0.5,0.8,1.0,1.2] [--per-frontend 2] [--batch-loads 0.3,0.5,0.8,0.95]

Writes .bench/frontends_scaling.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import Any

from harness import OUT_DIR, cell, write_json

from inferd.fleetsim.arrivals import ArrivalSpec, arrival_times
from inferd.fleetsim.batch_fleet import BatchFleet, FleetSpec
from inferd.fleetsim.profiles import BatchProfile
from inferd.fleetsim.report import Outcome
from inferd.models.sim import sim_config

MAX_BATCH = 100


def floats(raw: str) -> list[float]:
    return [float(x) for x in raw.split(",") if x]


def run(args: argparse.Namespace, frontends: int, devices: int, rate: float, seconds: float) -> dict[str, Any]:
    """One simulated run; its report and the devices' credit statistics."""
    profile = BatchProfile("sim-validate", 0.1, 0.001, frontend_s=args.frontend_us / 1e6, source="given")
    times = arrival_times(ArrivalSpec("poisson", rate, seed=args.seed), seconds)
    model = sim_config(base_ms=100.0, per_item_ms=1.0, max_batch_size=MAX_BATCH, max_wait_ms=10.0)
    spec = FleetSpec(model, profile, devices, times, frontends, warmup_s=args.warmup, seed=args.seed)

    async def main() -> tuple[BatchFleet, Any]:
        fleet = BatchFleet(spec)
        return fleet, fleet.run()

    started = time.process_time()
    fleet, report = asyncio.run(main())
    cpu = time.process_time() - started
    shared = fleet.shared or []
    end = float(times[-1])
    served = (fleet.outcome == Outcome.OK) & (fleet.done_at >= args.warmup) & (fleet.done_at < end)
    return {
        "frontends": frontends,
        "devices": devices,
        "offered_rps": report.offered_rps,
        "throughput_rps": report.throughput_rps,
        "served_rps": round(int(served.sum()) / (end - args.warmup), 1),
        "p50_ms": report.p50_ms,
        "p99_ms": report.p99_ms,
        "requests": report.requests,
        "rejected": report.rejected,
        "failed": report.failed + report.timeouts,
        "mean_batch_size": report.mean_batch_size,
        "answer_batch_size": report.answer_batch_size,
        "most_held": max((d.most_held for d in shared), default=None),
        "grants_per_batch": sum(d.ledger.statistics().granted for d in shared) / max(1, fleet.batches),
        "virtual_s": seconds,
        "cpu_s": round(cpu, 1),
    }


def scaling(args: argparse.Namespace) -> list[dict[str, Any]]:
    capacity = args.per_frontend * MAX_BATCH / (0.1 + 0.001 * MAX_BATCH)  # req/s per front end's devices
    ns = [int(n) for n in args.ns.split(",")]
    seconds = floats(args.seconds)
    if len(seconds) != len(ns):
        raise SystemExit("--seconds needs one value per --ns value")
    rows = []
    for load in floats(args.loads):
        one = None
        for n, s in zip(ns, seconds, strict=True):
            r = run(args, n, args.per_frontend * n, load * capacity * n, s) | {"load": load}
            one = r["served_rps"] if n == 1 else one
            r["scale"] = r["served_rps"] / (n * one) if one else None
            rows.append(r)
            print(f"  scaling: load {load:g} N {n}: {r['served_rps']:.0f} req/s, {r['cpu_s']} s", file=sys.stderr)
    return rows


def batches(args: argparse.Namespace) -> list[dict[str, Any]]:
    capacity = args.batch_devices * MAX_BATCH / (0.1 + 0.001 * MAX_BATCH)
    rows = []
    for load in floats(args.batch_loads):
        one, three = (
            run(args, fe, args.batch_devices, load * capacity, args.batch_seconds) | {"load": load}
            for fe in (1, args.batch_fe)
        )
        rows.append({
            "load": load,
            "one": one,
            "several": three,
            "ratio_per_batch": three["mean_batch_size"] / one["mean_batch_size"],
            "ratio_per_answer": three["answer_batch_size"] / one["answer_batch_size"],
        })  # fmt: skip
    return rows


def print_tables(scale_rows: list[dict[str, Any]], batch_rows: list[dict[str, Any]], fe: int) -> None:
    print("| load | front ends | devices | offered req/s | answered req/s | per device | scale (vs N x 1) "
          "| 429s | p50 ms | p99 ms | mean batch (per batch / per answer) | grants per batch | most held "
          "| sim CPU s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in scale_rows:
        print(
            f"| {r['load']:g} | {r['frontends']} | {r['devices']} | {cell(r['offered_rps'], 0)} | "
            f"{cell(r['served_rps'], 0)} | {cell(r['served_rps'] / r['devices'], 0)} | {cell(r['scale'], 3)} | "
            f"{r['rejected']:,} | {cell(r['p50_ms'])} | "
            f"{cell(r['p99_ms'])} | {r['mean_batch_size']:.1f} / {r['answer_batch_size']:.1f} | "
            f"{cell(r['grants_per_batch'], 2)} | {r['most_held'] if r['most_held'] is not None else '-'} | "
            f"{r['cpu_s']} |"
        )
    print(f"\n| load | mean batch, 1 front end (per batch / per answer) | {fe} front ends | ratio per batch "
          "| ratio per answer | p50 ms, 1 / several | p99 ms, 1 / several |")  # fmt: skip
    print("|---:|---|---|---:|---:|---|---|")
    for r in batch_rows:
        one, three = r["one"], r["several"]
        print(
            f"| {r['load']:g} | {one['mean_batch_size']:.1f} / {one['answer_batch_size']:.1f} | "
            f"{three['mean_batch_size']:.1f} / {three['answer_batch_size']:.1f} | {r['ratio_per_batch']:.3f} | "
            f"{r['ratio_per_answer']:.3f} | {cell(one['p50_ms'])} / {cell(three['p50_ms'])} | "
            f"{cell(one['p99_ms'])} / {cell(three['p99_ms'])} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="1,4,16,64", help="front ends of each scaling run")
    ap.add_argument("--seconds", default="10,10,6,3", help="virtual seconds of arrivals, one per --ns")
    ap.add_argument("--loads", default="0.5,0.8,1.0,1.2", help="offered load, x the devices' capacity")
    ap.add_argument("--per-frontend", type=int, default=2, help="devices per front end")
    ap.add_argument("--warmup", type=float, default=1.0, help="virtual seconds left out of each report")
    ap.add_argument("--frontend-us", type=float, default=140.0, help="front-end CPU per request")
    ap.add_argument("--batch-devices", type=int, default=2)
    ap.add_argument("--batch-fe", type=int, default=3, help="front ends compared with one")
    ap.add_argument("--batch-loads", default="0.3,0.5,0.8,0.95")
    ap.add_argument("--batch-seconds", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    logging.getLogger("inferd").setLevel(logging.ERROR)  # workers lost, overload: expected here
    scale_rows = scaling(args) if args.loads else []
    batch_rows = batches(args) if args.batch_loads else []
    print_tables(scale_rows, batch_rows, args.batch_fe)
    write_json(OUT_DIR / "frontends_scaling.json", {"scaling": scale_rows, "batches": batch_rows, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
