"""Cold start: the time to the first answer of a model with no worker serving it.

Two cases, each a `sim` model (--base-ms + --per-item-ms per item) and one request at a time (the
latency of that request, from its send to its checked answer: its own id and sim digest):

- **From zero workers**: a model with `workers = 0` and `[autoscale] min_workers = 0, max_workers = 1`
  (the scaling loop wakes it). For each of --trials, a fresh `inferd serve`: once it is ready, one
  request (it waits while a worker process starts and loads the model), then one more (now warm).
- **From an evicted pool model**: a pool of one worker with room for one model (`max_loaded_models =
  1`, `min_resident_s = 0`) and two pooled models a and b (`params.load_ms` --load-ms, `memory_mb`
  --memory-mb). Requests a, b, a, b, ... (--trials of each after the first), each then followed by a
  second one: every first request finds its model evicted by the other (the very first finds it never
  loaded) and waits for its load; the second is warm. The first request is sent once the pool worker
  has joined (the pool's own start is not counted).

Beside the client's times, the server's own: `inferd_cold_start_seconds` (from the first request held
with no worker in service to the first worker in service, by cause) and `inferd_model_load_seconds`,
from /metrics.

    .venv/bin/python benchmarks/cold_start.py [--trials 3] [--load-ms 200] [--memory-mb 64]
        [--only zero|pool]

Writes .bench/cold_start.json and prints a markdown table. Exits 1 when an answer was not a 200 with
the right digest, 2 when a server could not be started.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from typing import Any

from harness import OUT_DIR, InferdServer, ServerNotReady, cell, interrupt_on, write_json
from pool_zipf import POOL, Outcome, Workload, offer, scrape, wait_for_pool_workers

from inferd.bench.open_loop import run_blocking


def sim_toml(args: argparse.Namespace, head: str, tail: str = "") -> str:
    return f"""builtin = "sim"
{head}
max_batch_size = 8
max_wait_ms = 2
default_timeout_ms = {int(args.timeout_ms)}

[params]
base_ms = {args.base_ms:g}
per_item_ms = {args.per_item_ms:g}
{tail}"""


def one(url: str, name: str, args: argparse.Namespace, seed: int) -> Outcome:
    """One request to `name`, sent now; its outcome once answered (or timed out)."""
    return run_blocking(offer(url, Workload((name,), (0.0,), (0,)), args.timeout_ms, seed))[0]


def histogram(metrics: dict[str, dict[str, float]], name: str) -> dict[str, dict[str, float]]:
    """Label set -> {count, sum} of one histogram."""
    out: dict[str, dict[str, float]] = {}
    for suffix in ("count", "sum"):
        for labels, value in metrics.get(f"{name}_{suffix}", {}).items():
            out.setdefault(labels, {})[suffix] = value
    return out


def from_zero(args: argparse.Namespace) -> dict[str, Any]:
    toml = sim_toml(args, "workers = 0", "\n[autoscale]\nmin_workers = 0\nmax_workers = 1\n")
    trials = []
    for trial in range(args.trials):
        log = OUT_DIR / "cold_start" / f"zero-{trial}.log"
        with InferdServer("--log-level", "WARNING", name="cold_start_zero", models={"z": toml}, log_path=log,
                          ready_timeout_s=60.0, grace_s=15.0) as server:  # fmt: skip
            first = one(server.url, "z", args, 2 * trial)
            second = one(server.url, "z", args, 2 * trial + 1)
            metrics = scrape(server.url)
        trials.append({"server_ready_s": server.ready_s, "first": vars(first), "second": vars(second),
                       "cold_start": histogram(metrics, "inferd_cold_start_seconds")})  # fmt: skip
    return {"trials": trials}


def from_eviction(args: argparse.Namespace) -> dict[str, Any]:
    pooled = f'pool = "{POOL}"\nmemory_mb = {args.memory_mb:g}'
    toml = sim_toml(args, pooled, f"memory_mb = {args.memory_mb:g}\nload_ms = {args.load_ms:g}\n")
    config = f"""[pools.{POOL}]
workers = 1
memory_budget_mb = {1.5 * args.memory_mb:g}
max_loaded_models = 1
min_resident_s = 0
"""
    log = OUT_DIR / "cold_start" / "pool.log"
    trials = []
    with InferdServer("--log-level", "WARNING", name="cold_start_pool", config=config, models={"a": toml, "b": toml},
                      log_path=log, ready_timeout_s=60.0, grace_s=15.0) as server:  # fmt: skip
        wait_for_pool_workers(server.url, 1)
        for i in range(2 * args.trials + 1):
            name = "ab"[i % 2]
            first = one(server.url, name, args, 2 * i)
            second = one(server.url, name, args, 2 * i + 1)
            trials.append({"model": name, "evicted": i > 0, "first": vars(first), "second": vars(second)})
        metrics = scrape(server.url)
    return {"trials": trials, "cold_start": histogram(metrics, "inferd_cold_start_seconds"),
            "load_seconds": histogram(metrics, "inferd_model_load_seconds"),
            "loads": metrics.get("inferd_model_loads_total", {}),
            "evictions": metrics.get("inferd_model_evictions_total", {})}  # fmt: skip


def ms(trials: list[dict[str, Any]], which: str) -> list[float]:
    return [1000.0 * t[which]["latency_s"] for t in trials if t[which]["kind"] == "ok"]


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{cell(min(values))} / {cell(statistics.median(values))} / {cell(max(values))}"


def print_report(run: dict[str, Any]) -> None:
    a = run["args"]
    print(f"sim {a['base_ms']:g} ms + {a['per_item_ms']:g} ms/item; pool models: load {a['load_ms']:g} ms, "
          f"{a['memory_mb']:g} MB\n")  # fmt: skip
    print("| case | trials | first answer ms (min / median / max) | server: cold start s (count, mean) | "
          "next answer ms (min / median / max) | not ok |")  # fmt: skip
    print("|---|---:|---|---|---|---:|")
    if (zero := run.get("zero")) is not None:
        t = zero["trials"]
        cold = [v for trial in t for v in trial["cold_start"].values()]
        n, total = sum(c.get("count", 0) for c in cold), sum(c.get("sum", 0.0) for c in cold)
        print(f"| from zero workers (`min_workers = 0`) | {len(t)} | {spread(ms(t, 'first'))} | "
              f"{n:.0f}, {cell(total / n if n else None, 2)} | {spread(ms(t, 'second'))} | {not_ok(t)} |")  # fmt: skip
    if (pool := run.get("pool")) is not None:
        for label, evicted in (("pool model never loaded", False), ("pool model evicted", True)):
            t = [x for x in pool["trials"] if x["evicted"] == evicted]
            print(f"| {label} | {len(t)} | {spread(ms(t, 'first'))} | (below) | {spread(ms(t, 'second'))} | {not_ok(t)} |")
        cold, load = pool["cold_start"].values(), pool["load_seconds"].values()
        n, total = sum(c.get("count", 0) for c in cold), sum(c.get("sum", 0.0) for c in cold)
        ln, ltotal = sum(c.get("count", 0) for c in load), sum(c.get("sum", 0.0) for c in load)
        print(f"\npool, the server's own: {n:.0f} cold starts (pool_load), mean {cell(total / n if n else None, 3)} s; "
              f"{ln:.0f} loads (inferd_model_load_seconds, as the worker measured them), mean "
              f"{cell(ltotal / ln if ln else None, 3)} s; loads {pool['loads']}; evictions {pool['evictions']}")  # fmt: skip


def not_ok(trials: list[dict[str, Any]]) -> int:
    return sum(t[w]["kind"] != "ok" for t in trials for w in ("first", "second"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--base-ms", type=float, default=5.0)
    ap.add_argument("--per-item-ms", type=float, default=1.0)
    ap.add_argument("--load-ms", type=float, default=200.0)
    ap.add_argument("--memory-mb", type=float, default=64.0)
    ap.add_argument("--timeout-ms", type=float, default=30000.0)
    ap.add_argument("--only", choices=("zero", "pool"), default=None)
    args = ap.parse_args()
    if not 1 <= args.trials <= 10:
        raise SystemExit("--trials within 1..10")
    interrupt_on(signal.SIGTERM, signal.SIGHUP)
    run: dict[str, Any] = {"command": " ".join(sys.argv), "args": vars(args),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
    try:
        if args.only in (None, "zero"):
            run["zero"] = from_zero(args)
        if args.only in (None, "pool"):
            run["pool"] = from_eviction(args)
    except ServerNotReady as exc:
        print(f"cold_start: {exc}", file=sys.stderr)
        write_json(OUT_DIR / "cold_start.json", run)
        return 2
    write_json(OUT_DIR / "cold_start.json", run)
    print_report(run)
    failed = sum(not_ok(run[k]["trials"]) for k in ("zero", "pool") if k in run)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
