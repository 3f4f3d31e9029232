"""SLO-driven batching (`batching = "slo"`) against the best fixed max_batch_size x max_wait_ms, on bursty load
(gamma arrivals, CV 3), measured as goodput under the SLO: answers within latency_ms, per second.

(a) simulated: `inferd.fleetsim` drives inferd's own ModelRuntime on a virtual clock; the fixed grid is
    swept, the best fixed setting found, then the SLO policy runs on the same arrivals;
(b) real (unless --sim-only): `inferd serve` with the sim device (--base-ms, --per-item-ms), one worker,
    under the same gamma arrivals from the open-loop generator (`inferd bench --arrival gamma`), with
    the best fixed setting of (a) and with the SLO policy.

    .venv/bin/python benchmarks/slo_batching.py [--rate 1100] [--rates 800,1100,1400] [--latency-ms 100] [--sim-only]
        [--shed-lost]   # the real SLO run with [slo] shed_lost (the simulated part runs both)

Writes .bench/slo_batching.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from harness import OUT_DIR, InferdServer, write_json

from inferd.bench.loadgen import LoadSpec, run_load_blocking
from inferd.fleetsim.arrivals import ArrivalSpec, arrival_times
from inferd.fleetsim.batch_fleet import BatchFleet, FleetSpec
from inferd.fleetsim.profiles import BatchProfile
from inferd.fleetsim.report import Outcome
from inferd.models.sim import sim_config

SIZES = (32, 48, 64, 96, 128, 160, 192, 256)
WAITS_MS = (0.0, 2.0, 5.0, 10.0, 20.0)
QUEUE = 2000
"""max_queue_size of every run (fixed and SLO alike)."""


def simulate(args: argparse.Namespace, times: Any, shed: bool = False, **model: Any) -> dict[str, Any]:
    config = sim_config(
        base_ms=args.base_ms,
        per_item_ms=args.per_item_ms,
        max_queue_size=QUEUE,
        slo={"latency_ms": args.latency_ms, "shed_lost": shed},
        **model,
    )
    profile = BatchProfile(
        "given", args.base_ms / 1000, args.per_item_ms / 1000, jitter_cv=0.02, overhead_s=0.001
    )
    spec = FleetSpec(config, profile, 1, times, warmup_s=args.warmup)

    async def main() -> BatchFleet:
        fleet = BatchFleet(spec)
        fleet.run()
        return fleet

    loop = asyncio.new_event_loop()
    try:
        fleet = loop.run_until_complete(main())
    finally:
        loop.close()
    latency = fleet.done_at - times + profile.overhead_s
    window = times >= args.warmup
    good = window & (fleet.outcome == Outcome.OK) & (latency <= args.latency_ms / 1000)
    measured = float(times[-1]) - args.warmup
    return {
        "goodput_rps": round(float(good.sum()) / measured, 1),
        "offered_rps": round(float(window.sum()) / measured, 1),
        "mean_batch": round(fleet.batched_items / max(1, fleet.batches), 1),
        "refused": int((window & (fleet.outcome == Outcome.REJECTED)).sum()),
    }


def sim_part(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """The fixed grid and the SLO policy on the same arrivals at `rate`."""
    times = arrival_times(ArrivalSpec("gamma", rate, args.cv, seed=args.seed), args.warmup + args.duration)
    grid = {}
    for size in SIZES:
        for wait in WAITS_MS:
            grid[f"{size}x{wait:g}"] = simulate(args, times, max_batch_size=size, max_wait_ms=wait)
    best = max(grid, key=lambda k: grid[k]["goodput_rps"])
    worst = min(grid, key=lambda k: grid[k]["goodput_rps"])
    slo = simulate(args, times, max_batch_size=args.hard_cap, batching="slo")
    shed = simulate(args, times, True, max_batch_size=args.hard_cap, batching="slo")
    return {
        "rate": rate,
        "grid": grid,
        "best_fixed": best,
        "worst_fixed": worst,
        "slo": slo,
        "slo_shed": shed,
    }


def print_sim(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    print(
        f"| offered (gamma CV {args.cv:g}) | best fixed of {len(SIZES) * len(WAITS_MS)} (size x wait ms) "
        f"| its goodput/s | SLO policy goodput/s | SLO vs best | worst fixed goodput/s "
        f"| SLO + shed_lost goodput/s (429s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        best, worst = run["grid"][run["best_fixed"]], run["grid"][run["worst_fixed"]]
        slo = run["slo"]["goodput_rps"]
        delta = 100.0 * (slo - best["goodput_rps"]) / max(best["goodput_rps"], 1e-9)
        print(
            f"| {run['rate']:g} req/s ({run['slo']['offered_rps']}) | {run['best_fixed']} "
            f"| {best['goodput_rps']} | {slo} | {delta:+.1f}% | {worst['goodput_rps']} ({run['worst_fixed']}) "
            f"| {run['slo_shed']['goodput_rps']} ({run['slo_shed']['refused']}) |"
        )


MODEL_TOML = """\
builtin = "sim"
workers = 1
max_queue_size = {queue}
max_batch_size = {size}
max_wait_ms = {wait}
{batching}
[slo]
latency_ms = {latency_ms}
shed_lost = {shed}

[params]
base_ms = {base_ms}
per_item_ms = {per_item_ms}
"""


def real_run(args: argparse.Namespace, size: int, wait: float, batching: str) -> dict[str, Any]:
    toml = MODEL_TOML.format(
        queue=QUEUE,
        size=size,
        wait=wait,
        batching=f'batching = "{batching}"\n',
        latency_ms=args.latency_ms,
        shed=str(batching == "slo" and args.shed_lost).lower(),
        base_ms=args.base_ms,
        per_item_ms=args.per_item_ms,
    )
    serve = ("--no-admin", "--log-level", "WARNING")
    with InferdServer(*serve, models={"sim": toml}, name=f"slo_batching_{batching}", grace_s=30.0) as server:
        spec = LoadSpec(
            url=server.url,
            model="sim",
            rate=args.rate,
            duration_s=args.duration,
            warmup_s=args.warmup,
            arrival="gamma",
            arrival_cv=args.cv,
            slo_ms=args.latency_ms,
            seed=args.seed,
        )
        m = run_load_blocking(spec).measured
    return {
        "goodput_rps": m.goodput_rps,
        "offered_rps": round(m.offered_rps, 1),
        "ok": m.ok,
        "errors": m.errors,
        "latency_ms": m.latency_ms,
        "mean_batch": m.batch_size.get("mean"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1100.0)
    ap.add_argument(
        "--rates", help="comma-separated rates to simulate (default: --rate); the real run uses --rate"
    )
    ap.add_argument("--cv", type=float, default=3.0)
    ap.add_argument(
        "--shed-lost", action="store_true", help="the real SLO run sheds lost requests ([slo] shed_lost)"
    )
    ap.add_argument("--latency-ms", type=float, default=100.0)
    ap.add_argument("--base-ms", type=float, default=20.0)
    ap.add_argument("--per-item-ms", type=float, default=0.5)
    ap.add_argument("--hard-cap", type=int, default=256, help="max_batch_size of the SLO runs")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sim-only", action="store_true")
    ap.add_argument("--fixed", help="SIZExWAIT_MS: skip the simulation, run this fixed setting for real")
    args = ap.parse_args()
    results: dict[str, Any] = {"command": " ".join(sys.argv)}
    if args.fixed:
        size, wait = args.fixed.split("x")
    else:
        rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
        runs = results["sim"] = [sim_part(args, rate) for rate in rates]
        print_sim(args, runs)
        at_rate = [r for r in runs if r["rate"] == args.rate] or runs  # the real run's rate, if simulated
        size, wait = at_rate[0]["best_fixed"].split("x")
    if not args.sim_only:
        results["real"] = {
            "fixed": real_run(args, int(size), float(wait), "fixed"),
            "slo": real_run(args, args.hard_cap, 10.0, "slo"),
        }
        for name, r in results["real"].items():
            print(
                f"real {name}: goodput {r['goodput_rps']} req/s, latency {r['latency_ms']}, errors {r['errors']}"
            )
    write_json(OUT_DIR / "slo_batching.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
