"""Fleet benchmarks: scaling across workers, priority classes, rolling updates and drains, against a real
`inferd serve` started from a temporary model repository.

The served model is `sim` at base_ms=100, per_item_ms=1, max_batch_size=100: a full batch takes 200 ms,
so one worker tops out near 500 req/s. Each subcommand starts its own server (its own process group),
offers open-loop load with `inferd.bench.loadgen`, always stops the server, writes JSON under .bench/
and prints a markdown summary.

    python benchmarks/fleet.py scaling    [--workers 1,2,4] [--fractions 0.6,0.8,0.9,0.95] [--duration 10]
    python benchmarks/fleet.py priorities [--duration 10]   # 2 workers, bulk at 3x capacity + interactive 10%
    python benchmarks/fleet.py rolling    [--duration 20]   # 2 workers, 60% load, update to version 2 mid-run
    python benchmarks/fleet.py drain      [--duration 20]   # 2 workers, 60% load, drain one worker mid-run
    python benchmarks/fleet.py autoscale  [--before 15 --step 30 --after 45]  # 1..4 workers, 20% -> 150% -> 20%

* scaling: for each worker count N, a ladder of offered rates (fractions of 500 x N). Sustained = the
  highest rate with no errors, >= 90% achieved and p99 <= 2x the p99 of the single-worker sustained
  rate (for N=1: the highest rate with no errors and >= 90% achieved). Linearity = sustained(N) /
  (N x sustained(1)). Server CPU per request from /proc of the server's process tree.
* priorities: `bulk` at 3x fleet capacity and `interactive` at 10% of it, concurrently (two load
  specs in one event loop), and an `interactive`-alone baseline. Reports interactive p99 with bulk vs
  alone (target <= 1.5x) and bulk goodput vs the capacity interactive leaves (target >= 80%).
* rolling: creates version folder 2 and POSTs /admin/models/sim/update in the middle of the run;
  reports the load tool's invariants (lost, duplicated, misrouted, errors; target zero) and how long
  the update took.
* drain: POSTs /admin/workers/{id}/drain for one ready worker mid-run; reports the invariants and how
  long until the fleet is back to its ready worker count.
* autoscale: 1 worker with an `[autoscale]` table (min 1, max 4; values in the JSON); one open-loop
  Poisson run whose rate steps 20% -> 150% -> 20% of one worker's capacity (100 -> 750 -> 100 req/s
  for 15, 30, 45 s) while GET /admin/workers is polled every 0.5 s. Reports time from the step up to
  the first scale-up (decision, from the server's INFO log, and first extra ready worker) and to the
  peak ready count, p99 over the step and its last 10 s, errors in the step, the scale-downs after
  the step back with the requests failed from the first one on (target zero: drained first), and
  scaling decisions and ready-count changes per minute in each constant-load phase.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from harness import (
    OUT_DIR,
    InferdServer,
    ServerProcess,
    cell,
    free_port,
    inferd_command,
    interrupt_on,
    write_json,
)
from procfs import cpu_seconds_since

from inferd.bench.loadgen import LoadSpec, offer_load, run_load, run_load_blocking
from inferd.bench.open_loop import arrival_offsets, run_blocking
from inferd.bench.report import LoadReport, Recorder

PER_WORKER_RPS = 500.0
"""Full-batch capacity of one worker: 100 items per 100 + 1 x 100 ms."""

MODEL_TOML = """\
builtin = "sim"
workers = {workers}
max_batch_size = 100

[params]
base_ms = 100.0
per_item_ms = 1.0
"""

SERVER_TOML = """\
[server]
admin_host = "127.0.0.1"
admin_port = {admin_port}
log_level = "WARNING"
"""


# ---- server -------------------------------------------------------------------------------------------


class Server(InferdServer):
    """`inferd serve` on a temporary model repository holding sim (version 1) with `workers` workers, its
    admin API on a free port; ready when all the workers are and /v2/health/ready answers."""

    def __init__(
        self,
        workers: int,
        name: str,
        model_extra: str = "",
        log_level: str = "WARNING",
        server_extra: str = "",
    ) -> None:
        self.admin_port = free_port()
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.workers = workers
        server_toml = SERVER_TOML.format(admin_port=self.admin_port)
        super().__init__(
            name=f"fleet_{name}",
            config=server_toml.replace('"WARNING"', f'"{log_level}"') + server_extra,
            models={"sim": MODEL_TOML.format(workers=workers) + model_extra},
            log_path=OUT_DIR / f"fleet_{name}_server.log",
        )
        (self.repo / "sim" / "1").mkdir()

    def ready(self) -> bool:
        return len(self.ready_workers()) >= self.workers and super().ready()

    def admin_call(self, method: str, path: str, timeout: float = 120.0) -> Any:
        req = urllib.request.Request(
            f"{self.admin}{path}", method=method, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def ready_workers(self) -> list[dict[str, Any]]:
        rows = self.admin_call("GET", "/admin/workers", timeout=2)["workers"]
        return [w for w in rows if w["model"] == "sim" and w["state"] == "ready"]

    def __enter__(self) -> Server:
        super().__enter__()
        print(
            f"server ready in {self.ready_s:.1f} s ({self.workers} worker(s), {self.url}, admin {self.admin})",
            flush=True,
        )
        return self


# ---- helpers ------------------------------------------------------------------------------------------


def spec(url: str, rate: float, args: argparse.Namespace, **kw: Any) -> LoadSpec:
    kw.setdefault("seed", int(rate))
    return LoadSpec(
        url=url,
        model="sim",
        rate=rate,
        duration_s=args.duration,
        warmup_s=args.warmup,
        timeout_ms=args.timeout_ms,
        **kw,
    )


def summary(report: LoadReport) -> dict[str, Any]:
    m = report.measured
    return {
        "offered": round(m.offered_rps, 1),
        "achieved": round(m.achieved_rps, 1),
        "ok": m.ok,
        "sent": m.sent,
        "errors": m.errors,
        "mismatched": report.mismatched_total,
        "latency_ms": m.latency_ms,
        "queue_ms": m.queue_ms,
        "batch_mean": m.batch_size["mean"],
        "goodput_rps": m.goodput_rps,
        "invariants": report.invariants,
        "generator_cpu_us_per_request": round(report.cpu_us_per_request, 1),
    }


def p99(r: dict[str, Any]) -> float | None:
    return r["latency_ms"].get("p99")


def basic_ok(r: dict[str, Any]) -> bool:
    return (
        not r["errors"] and not r["mismatched"] and r["achieved"] >= 0.9 * r["offered"] and p99(r) is not None
    )


# ---- subcommands --------------------------------------------------------------------------------------


def cmd_scaling(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(x) for x in args.workers.split(",")]
    fractions = [float(x) for x in args.fractions.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {}
    for n in counts:
        runs[n] = []
        with Server(n, f"scaling{n}") as srv:
            for f in fractions:
                rate = round(f * PER_WORKER_RPS * n, 1)
                before = srv.cpu_ticks()
                report = run_load_blocking(spec(srv.url, rate, args))
                server_cpu_s = cpu_seconds_since(before, srv.pids())
                r = summary(report) | {"workers": n, "fraction": f, "rate": rate}
                r["server_cpu_us_per_request"] = round(1e6 * server_cpu_s / max(1, report.sent), 1)
                runs[n].append(r)
                print(
                    f"  N={n} offered {rate:g}: achieved {r['achieved']:g}, p99 {cell(p99(r))} ms, "
                    f"errors {r['errors']}, server CPU {r['server_cpu_us_per_request']} us/req",
                    flush=True,
                )
    # Single-worker sustained: no errors and >= 90% achieved; its p99 sets the bound for every count.
    base = [r for r in runs.get(1, []) if basic_ok(r)]
    bound = 2 * p99(base[-1]) if base else None
    sustained: dict[int, dict[str, Any] | None] = {}
    for n, rs in runs.items():
        good = [r for r in rs if basic_ok(r) and bound is not None and p99(r) <= bound]
        sustained[n] = max(good, key=lambda r: r["rate"]) if good else None
    s1 = sustained.get(1)
    out: dict[str, Any] = {"p99_bound_ms": bound, "runs": runs, "sustained": {}}
    print(f"\np99 bound (2x single-worker sustained p99): {cell(bound)} ms\n")
    print(
        "| workers | offered req/s | achieved | p50 ms | p99 ms | errors | mean batch | server CPU us/req |"
    )
    print("|---:|---:|---:|---:|---:|---|---:|---:|")
    for n, rs in runs.items():
        for r in rs:
            errs = sum(r["errors"].values())
            print(
                f"| {n} | {r['rate']:,.0f} | {r['achieved']:,.0f} | {cell(r['latency_ms'].get('p50'))} | "
                f"{cell(p99(r))} | {errs or 0} | {cell(r['batch_mean'])} | {r['server_cpu_us_per_request']:.0f} |"
            )
    print("\n| workers | sustained req/s | p99 ms | linearity | server CPU us/req |")
    print("|---:|---:|---:|---:|---:|")
    for n, s in sustained.items():
        lin = s["rate"] / (n * s1["rate"]) if s and s1 else None
        out["sustained"][n] = {
            "rate": s["rate"] if s else None,
            "p99_ms": p99(s) if s else None,
            "linearity": lin,
            "server_cpu_us_per_request": s["server_cpu_us_per_request"] if s else None,
        }
        print(
            f"| {n} | {cell(s['rate'] if s else None, 0)} | {cell(p99(s) if s else None)} | "
            f"{cell(lin, 2)} | {cell(s['server_cpu_us_per_request'] if s else None, 0)} |"
        )
    return out


def cmd_priorities(args: argparse.Namespace) -> dict[str, Any]:
    n = 2
    capacity = PER_WORKER_RPS * n
    bulk_rate, inter_rate = args.bulk_factor * capacity, args.interactive_share * capacity
    with Server(n, "priorities") as srv:
        alone = run_load_blocking(spec(srv.url, inter_rate, args, priority="interactive", seed=1))
        print(f"  interactive alone: p99 {cell(alone.measured.latency_ms.get('p99'))} ms", flush=True)

        async def both() -> tuple[LoadReport, LoadReport]:
            return await asyncio.gather(
                run_load(spec(srv.url, bulk_rate, args, priority="bulk", seed=2)),
                run_load(spec(srv.url, inter_rate, args, priority="interactive", seed=3)),
            )

        before = srv.cpu_ticks()
        bulk, inter = run_blocking(both())
        server_cpu_s = cpu_seconds_since(before, srv.pids())
    a, i, b = summary(alone), summary(inter), summary(bulk)
    spare = capacity - inter.measured.achieved_rps
    ratio = p99(i) / p99(a) if p99(i) and p99(a) else None
    bulk_share = b["achieved"] / spare if spare > 0 else None
    out = {
        "capacity_rps": capacity,
        "interactive_alone": a,
        "interactive_with_bulk": i,
        "bulk": b,
        "interactive_p99_ratio": ratio,
        "bulk_goodput_over_spare": bulk_share,
        "spare_capacity_rps": spare,
        "server_cpu_us_per_request": round(1e6 * server_cpu_s / max(1, bulk.sent + inter.sent), 1),
    }
    print(
        f"\n2 workers (capacity {capacity:,.0f} req/s), bulk offered {bulk_rate:,.0f}, interactive {inter_rate:,.0f}\n"
    )
    print("| run | offered req/s | achieved | p50 ms | p99 ms | errors |")
    print("|---|---:|---:|---:|---:|---|")
    for label, r in (("interactive alone", a), ("interactive with bulk", i), ("bulk", b)):
        print(
            f"| {label} | {r['offered']:,.0f} | {r['achieved']:,.0f} | {cell(r['latency_ms'].get('p50'))} | "
            f"{cell(p99(r))} | {r['errors'] or 0} |"
        )
    print(f"\ninteractive p99 with bulk / alone: {cell(ratio, 2)}x (target <= 1.5x)")
    print(
        f"bulk goodput {b['achieved']:,.0f} req/s of {spare:,.0f} spare: {cell(100 * bulk_share if bulk_share else None, 0)}% "
        "(target >= 80%)"
    )
    return out


def _load_with_mid_run_action(
    srv: Server, rate: float, args: argparse.Namespace, seed: int, action: Any, join_s: float
) -> tuple[LoadReport, dict[str, Any], float]:
    """Offer load while `action` runs once, in a thread, halfway through the measured window. Returns the
    report, what the action returned (or the error it raised) and when it started (s from load start)."""
    at = args.warmup + args.duration / 2
    result: dict[str, Any] = {}

    def go() -> None:
        time.sleep(at)
        try:
            result.update(action())
        except Exception as exc:  # reported, not fatal to the load run
            result["error"] = repr(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    report = run_load_blocking(spec(srv.url, rate, args, seed=seed))
    t.join(join_s)
    return report, result, at


def _wait_workers(srv: Server, count: int, timeout_s: float, exclude: set[str] = frozenset()) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            ready = [w for w in srv.ready_workers() if w["worker_id"] not in exclude]
            if len(ready) >= count:
                return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    return None


def _invariants_table(label: str, r: dict[str, Any]) -> None:
    inv = r["invariants"]
    failed = r["sent"] - r["ok"]
    print("| run | offered req/s | achieved | p50 ms | p99 ms | lost | duplicated | misrouted | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    print(
        f"| {label} | {r['offered']:,.0f} | {r['achieved']:,.0f} | {cell(r['latency_ms'].get('p50'))} | "
        f"{cell(p99(r))} | {inv['lost']} | {inv['duplicated']} | {inv['misrouted']} | "
        f"{inv['errors'] or 0} (failed in window: {failed}) |"
    )


def cmd_slow(args: argparse.Namespace) -> dict[str, Any]:
    """RELIABILITY F3: 1 of 4 workers 10x slower (a remote worker with INFERD_SIM_SLOWDOWN), vs the same
    fleet with all 4 healthy: traffic moved off it, fleet p99, how much of the fleet was ejected."""
    rate = args.load * PER_WORKER_RPS * 4
    out: dict[str, Any] = {"rate": rate, "slowdown": args.slowdown}
    for label, slowdown in (("baseline", 1.0), ("slow", args.slowdown)):
        out[label] = _slow_run(label, slowdown, rate, args)
    base, slow = out["baseline"], out["slow"]
    ratio = p99(slow["load"]) / p99(base["load"]) if p99(slow["load"]) and p99(base["load"]) else None
    out["p99_ratio"] = ratio
    print(f"\n4 workers (one remote), {rate:,.0f} req/s, slow worker x{args.slowdown:g}\n")
    print(
        "| run | achieved | p50 ms | p99 ms | errors | slow worker's share of batches after 10 s | most ejected at once |"
    )
    print("|---|---:|---:|---:|---|---:|---:|")
    for label in ("baseline", "slow"):
        r = out[label]
        print(
            f"| {label} | {r['load']['achieved']:,.0f} | {cell(r['load']['latency_ms'].get('p50'))} | "
            f"{cell(p99(r['load']))} | {r['load']['errors'] or 0} | {r['remote_share_after_10s']:.1%} | "
            f"{r['max_ejected']} of 4 |"
        )
    print(f"\nfleet p99 slow / baseline: {cell(ratio, 2)}x (target <= 1.5x)")
    print(
        f"traffic moved off the slow worker: {1 - out['slow']['remote_share_after_10s'] / 0.25:.0%} of its fair "
        "share (target >= 80% within 10 s)"
    )
    return out


def _slow_run(label: str, slowdown: float, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    token = os.urandom(8).hex()
    os.environ["INFERD_JOIN_TOKEN"] = token
    wport = free_port()
    with Server(3, f"slow_{label}", server_extra=f"worker_port = {wport}\n") as srv:
        worker = ["--connect", f"127.0.0.1:{wport}", "--model", "sim", "--worker-id", "remote-1"]
        remote = ServerProcess(
            inferd_command("worker", *worker, "--log-level", "WARNING"),
            name=f"fleet_slow_{label}_worker",
            log_path=OUT_DIR / f"fleet_slow_{label}_worker.log",
            env={"INFERD_SIM_SLOWDOWN": str(slowdown)},
            grace_s=30.0,
        )
        remote.start()
        try:
            if _wait_workers(srv, 4, 60) is None:
                raise RuntimeError("the remote worker did not join")
            samples: list[tuple[float, dict[str, Any]]] = []
            stop = threading.Event()

            def poll() -> None:
                t0 = time.monotonic()
                while not stop.is_set():
                    try:
                        rows = srv.admin_call("GET", "/admin/workers", timeout=2)["workers"]
                        samples.append((time.monotonic() - t0, {w["worker_id"]: w for w in rows}))
                    except (urllib.error.URLError, OSError):
                        pass
                    stop.wait(0.5)

            th = threading.Thread(target=poll, daemon=True)
            th.start()
            report = run_load_blocking(spec(srv.url, rate, args, seed=5))
            stop.set()
            th.join(5)
        finally:
            remote.stop()
    return {"load": summary(report), **_batch_shares(samples, "remote-1")}


def _batch_shares(samples: list[tuple[float, dict[str, Any]]], worker: str) -> dict[str, Any]:
    """The worker's share of completed batches from 10 s after the load started to its end, and the most
    workers ejected at one poll."""
    later = [(t, rows) for t, rows in samples if t >= 10.0]
    if len(later) < 2:
        return {"remote_share_after_10s": float("nan"), "max_ejected": 0}

    def done(rows: dict[str, Any], wid: str) -> int:
        return rows[wid]["completed_batches"] if wid in rows else 0

    def completed(wid: str) -> int:
        """Batches completed between the first and last sample; a worker that reconnected (killed as
        hung, say) starts counting from 0 again."""
        total = 0
        for (_, prev), (_, cur) in itertools.pairwise(later):
            a, b = done(prev, wid), done(cur, wid)
            total += b - a if b >= a else b
        return total

    workers = {w for _, rows in later for w in rows}
    total = sum(completed(w) for w in workers)
    mine = completed(worker)
    ejected = max(
        sum(1 for w in rows.values() if w.get("ejection", {}).get("state") == "ejected")
        for _, rows in samples
    )
    return {"remote_share_after_10s": mine / total if total else float("nan"), "max_ejected": ejected}


def cmd_rolling(args: argparse.Namespace) -> dict[str, Any]:
    n = 2
    rate = args.load * PER_WORKER_RPS * n
    with Server(n, "rolling") as srv:
        before = srv.ready_workers()

        def update() -> dict[str, Any]:
            (srv.repo / "sim" / "2").mkdir()
            t = time.monotonic()
            answer = srv.admin_call("POST", "/admin/models/sim/update", timeout=120)
            return {"update_s": round(time.monotonic() - t, 3), "answer": answer}

        report, result, at = _load_with_mid_run_action(srv, rate, args, 7, update, join_s=120)
        after = srv.ready_workers()
    r = summary(report)
    out = {
        "rate": rate,
        "update_at_s": at,
        "update": result,
        "load": r,
        "workers_before": [(w["worker_id"], w["version"]) for w in before],
        "workers_after": [(w["worker_id"], w["version"]) for w in after],
    }
    print(f"\n2 workers, {rate:,.0f} req/s, update v1 -> v2 at t={at:g} s (from load start)\n")
    _invariants_table("rolling update", r)
    print(f"\nupdate: {result}")
    print(f"workers after: {out['workers_after']}")
    return out


def cmd_drain(args: argparse.Namespace) -> dict[str, Any]:
    n = 2
    rate = args.load * PER_WORKER_RPS * n
    with Server(n, "drain") as srv:

        def drain() -> dict[str, Any]:
            victim = srv.ready_workers()[0]["worker_id"]
            t = time.monotonic()
            answer = srv.admin_call("POST", f"/admin/workers/{victim}/drain", timeout=10)
            call_s = time.monotonic() - t
            back = _wait_workers(srv, n, 60.0, exclude={victim})
            return {
                "worker_id": victim,
                "answer": answer,
                "drain_call_s": round(call_s, 3),
                "back_to_ready_s": None if back is None else round(back, 3),
            }

        report, result, at = _load_with_mid_run_action(srv, rate, args, 9, drain, join_s=60)
        after = srv.ready_workers()
    r = summary(report)
    out = {"rate": rate, "drain_at_s": at, "drain": result, "load": r, "workers_after": after}
    print(f"\n2 workers, {rate:,.0f} req/s, drain one worker at t={at:g} s (from load start)\n")
    _invariants_table("drain", r)
    print(f"\ndrain: {result}")
    return out


AUTOSCALE = {
    "min_workers": 1,
    "max_workers": 4,
    "target_busy_ratio": 0.7,
    "max_predicted_wait_s": 0.5,
    "scale_up_cooldown_s": 5.0,
    "scale_down_cooldown_s": 20.0,
    "scale_down_stabilization_s": 10.0,
}
DECISION_RE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ inferd\.autoscaler model sim: (\d+) -> (\d+) workers \((.*)\)$"
)


def _autoscale_toml(cfg: dict[str, Any]) -> str:
    return "\n[autoscale]\n" + "".join(f"{k} = {v}\n" for k, v in cfg.items())


def _stepped_load(
    url: str, phases: list[tuple[str, float, float]], windows: list[tuple[str, float, float]], args: Any
) -> tuple[list[float], list[float], dict[str, Recorder], float, float]:
    """Open-loop Poisson load whose rate steps through `phases` (name, rate, seconds), in one run: one
    client, one dispatcher, requests numbered across phases. Each request is recorded in the window
    (name, start, end) holding its intended time. Returns offsets, per-request latency (s; -1 failed,
    NaN unsent), the window recorders, and t0 on the monotonic and the wall clock."""
    offsets: list[float] = []
    start = 0.0
    for k, (_, rate, length) in enumerate(phases):
        part = LoadSpec(url=url, model="sim", rate=rate, duration_s=length, seed=args.seed + k)
        offsets += [start + off for off in arrival_offsets(part)]
        start += length
    spec = LoadSpec(
        url=url,
        model="sim",
        rate=max(rate for _, rate, _ in phases),
        duration_s=start,
        timeout_ms=args.timeout_ms,
        seed=args.seed,
        max_requests=max(1, len(offsets)),
    )
    recorders = {name: Recorder() for name, _, _ in windows}
    rec_of = [next(recorders[n] for n, a, b in windows if a <= off < b) for off in offsets]
    wall_t0: list[float] = []

    def on_start(t0: float) -> None:
        wall_t0.append(time.time() + (t0 - time.monotonic()))

    offered = run_blocking(offer_load(spec, offsets, lambda i, _: rec_of[i], on_start=on_start))
    return offsets, offered.results, recorders, offered.t0, wall_t0[0]


class _WorkerPoller(threading.Thread):
    """GET /admin/workers every `every_s`; keeps (monotonic time, {state: count}) for model sim."""

    def __init__(self, srv: Server, every_s: float) -> None:
        super().__init__(daemon=True)
        self.srv, self.every_s = srv, every_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.failed_polls = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        nxt = time.monotonic()
        while not self._stop_event.is_set():
            t = time.monotonic()
            try:
                rows = self.srv.admin_call("GET", "/admin/workers", timeout=2)["workers"]
                states: dict[str, int] = {}
                for w in rows:
                    if w["model"] == "sim":
                        states[w["state"]] = states.get(w["state"], 0) + 1
                self.samples.append((t, states))
            except (urllib.error.URLError, OSError, ValueError):
                self.failed_polls += 1
            nxt += self.every_s
            self._stop_event.wait(max(0.0, nxt - time.monotonic()))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


def _decisions(log_path: Path, wall_t0: float) -> list[dict[str, Any]]:
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        m = DECISION_RE.match(line)
        if m:
            wall = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append({"t": round(wall - wall_t0, 3), "from": int(m[2]), "to": int(m[3]), "reason": m[4]})
    return out


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(xs) * 1000.0, q)), 1) if xs else None


def cmd_autoscale(args: argparse.Namespace) -> dict[str, Any]:
    low, high = args.low * PER_WORKER_RPS, args.high * PER_WORKER_RPS
    phases = [("low", low, args.before), ("step", high, args.step), ("back", low, args.after)]
    step_at, back_at = args.before, args.before + args.step
    end = back_at + args.after
    tail = min(10.0, args.step)
    windows = [
        ("low", 0.0, step_at),
        ("step_head", step_at, back_at - tail),
        ("step_tail", back_at - tail, back_at),
        ("back", back_at, end),
    ]
    cfg = dict(AUTOSCALE, min_workers=1, max_workers=args.max_workers)
    with Server(1, "autoscale", model_extra=_autoscale_toml(cfg), log_level="INFO") as srv:
        poller = _WorkerPoller(srv, args.poll_s)
        poller.start()
        time.sleep(2 * args.poll_s)
        try:
            offsets, results, recs, t0, wall_t0 = _stepped_load(srv.url, phases, windows, args)
            time.sleep(2 * args.poll_s)
        finally:
            poller.stop()
        log_path = srv.log_path
    decisions = _decisions(log_path, wall_t0)
    timeline = [
        {"t": round(t - t0, 3), "ready": s.get("ready", 0), "draining": s.get("draining", 0), "states": s}
        for t, s in poller.samples
    ]

    # Ready-worker count: first rise after the step, first time at its peak, falls after the step back.
    before = [p["ready"] for p in timeline if p["t"] < step_at]
    base = before[-1] if before else 1
    after_step = [p for p in timeline if p["t"] >= step_at]
    peak = max((p["ready"] for p in after_step), default=base)
    first_up_ready = next((p["t"] - step_at for p in after_step if p["ready"] > base), None)
    peak_at = next((p["t"] - step_at for p in after_step if p["ready"] == peak), None)
    changes, prev = [], None
    for p in timeline:
        if prev is not None and p["ready"] != prev:
            changes.append({"t": p["t"], "from": prev, "to": p["ready"]})
        prev = p["ready"]
    downs_ready = [dict(c, after_back_s=round(c["t"] - back_at, 2)) for c in changes if c["to"] < c["from"]]
    ups = [d for d in decisions if d["to"] > d["from"] and d["t"] >= step_at]
    downs = [d for d in decisions if d["to"] < d["from"] and d["t"] >= back_at]
    first_up_decision = ups[0]["t"] - step_at if ups else None

    # Latency and failures from the per-request record (intended time = offset).
    res = np.asarray(results, dtype=float)
    offs = np.asarray(offsets, dtype=float)

    def ok_lat(a: float, b: float) -> list[float]:
        sel = (offs >= a) & (offs < b) & (res >= 0)
        return res[sel].tolist()

    def failed(a: float, b: float) -> int:
        sel = (offs >= a) & (offs < b)
        return int(np.sum(sel & ~(res >= 0)))

    def merged_errors(*names: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in names:
            for k, v in recs[n].errors.items():
                out[k] = out.get(k, 0) + v
            for k, v in recs[n].mismatches.items():
                out[f"mismatch_{k}"] = out.get(f"mismatch_{k}", 0) + v
        return out

    first_down_t = downs[0]["t"] if downs else None
    phase_rows = {}
    for name, a, b in (("low", 0.0, step_at), ("step", step_at, back_at), ("back", back_at, end)):
        lat = ok_lat(a, b)
        n_dec = [d for d in decisions if a <= d["t"] < b]
        n_ready = [c for c in changes if a <= c["t"] < b]
        phase_rows[name] = {
            "window_s": [a, b],
            "offered_rps": round(int(np.sum((offs >= a) & (offs < b))) / (b - a), 1),
            "ok": len(lat),
            "failed": failed(a, b),
            "p50_ms": _pct(lat, 50),
            "p99_ms": _pct(lat, 99),
            "decisions": len(n_dec),
            "decisions_per_min": round(60.0 * len(n_dec) / (b - a), 2),
            "ready_changes": len(n_ready),
            "ready_changes_per_min": round(60.0 * len(n_ready) / (b - a), 2),
        }
    phase_rows["low"]["errors"] = merged_errors("low")
    phase_rows["step"]["errors"] = merged_errors("step_head", "step_tail")
    phase_rows["back"]["errors"] = merged_errors("back")
    step_tail = ok_lat(back_at - tail, back_at)
    out = {
        "autoscale": cfg,
        "model": {
            "builtin": "sim",
            "base_ms": 100.0,
            "per_item_ms": 1.0,
            "max_batch_size": 100,
            "workers": 1,
        },
        "phases": [{"name": n, "rate": r, "seconds": s} for n, r, s in phases],
        "poll_s": args.poll_s,
        "failed_polls": poller.failed_polls,
        "step_at_s": step_at,
        "back_at_s": back_at,
        "first_scale_up_decision_s": None if first_up_decision is None else round(first_up_decision, 2),
        "first_ready_increase_s": None if first_up_ready is None else round(first_up_ready, 2),
        "ready_peak": peak,
        "ready_peak_reached_s": None if peak_at is None else round(peak_at, 2),
        "step_p99_ms": phase_rows["step"]["p99_ms"],
        "step_last_p99_ms": _pct(step_tail, 99),
        "step_last_window_s": tail,
        "scale_down_decisions": [dict(d, after_back_s=round(d["t"] - back_at, 2)) for d in downs],
        "scale_down_ready": downs_ready,
        "failed_from_first_scale_down": None if first_down_t is None else failed(first_down_t, end),
        "phase": phase_rows,
        "decisions": decisions,
        "ready_changes": changes,
        "timeline": timeline,
        "server_log": str(log_path),
    }
    _autoscale_report(out)
    return out


def _autoscale_report(out: dict[str, Any]) -> None:
    ph = out["phase"]
    print(f"\nautoscale {out['autoscale']}")
    steps = [f"{p['name']} {p['rate']:g} req/s x {p['seconds']:g} s" for p in out["phases"]]
    print(f"load: {', '.join(steps)}\n")
    print(
        "| phase | offered req/s | ok | failed | errors | p50 ms | p99 ms | decisions (/min) | ready changes (/min) |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for name, r in ph.items():
        print(
            f"| {name} {r['window_s'][0]:g}-{r['window_s'][1]:g} s | {r['offered_rps']:,.0f} | {r['ok']} | "
            f"{r['failed']} | {r['errors'] or 0} | {cell(r['p50_ms'])} | {cell(r['p99_ms'])} | "
            f"{r['decisions']} ({r['decisions_per_min']:g}) | {r['ready_changes']} ({r['ready_changes_per_min']:g}) |"
        )
    print("\n| metric | value |")
    print("|---|---|")
    print(f"| step up -> first scale-up decision | {cell(out['first_scale_up_decision_s'], 2)} s |")
    print(f"| step up -> first extra worker ready | {cell(out['first_ready_increase_s'], 2)} s |")
    print(
        f"| step up -> ready count at its peak ({out['ready_peak']}) | {cell(out['ready_peak_reached_s'], 2)} s |"
    )
    step_s = out["back_at_s"] - out["step_at_s"]
    print(f"| p99 over the step ({step_s:g} s) | {cell(out['step_p99_ms'])} ms |")
    print(
        f"| p99 over the step's last {out['step_last_window_s']:g} s | {cell(out['step_last_p99_ms'])} ms |"
    )
    print(f"| errors during the step | {ph['step']['errors'] or 0} (failed {ph['step']['failed']}) |")
    downs = ", ".join(
        f"{d['from']}->{d['to']} at +{d['after_back_s']:g} s" for d in out["scale_down_decisions"]
    )
    print(f"| scale-down decisions after the step back | {downs or 'none'} |")
    ready = ", ".join(f"{d['from']}->{d['to']} at +{d['after_back_s']:g} s" for d in out["scale_down_ready"])
    print(f"| ready count falls after the step back | {ready or 'none'} |")
    print(
        f"| failed requests from the first scale-down on (target 0) | {out['failed_from_first_scale_down']} |"
    )
    print("\ndecisions (t from load start):")
    for d in out["decisions"]:
        print(f"  t={d['t']:7.2f} s  {d['from']} -> {d['to']}  ({d['reason']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the window")
    common.add_argument("--timeout-ms", type=float, default=5000.0, help="client deadline per request")
    p = sub.add_parser("scaling", parents=[common])
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--fractions", default="0.6,0.8,0.9,0.95", help="of 500 req/s x workers")
    p.add_argument("--duration", type=float, default=10.0)
    p = sub.add_parser("priorities", parents=[common])
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--bulk-factor", type=float, default=3.0, help="bulk offered, x fleet capacity")
    p.add_argument("--interactive-share", type=float, default=0.1, help="interactive offered, x capacity")
    for name in ("rolling", "drain"):
        p = sub.add_parser(name, parents=[common])
        p.add_argument("--duration", type=float, default=20.0)
        p.add_argument("--load", type=float, default=0.6, help="offered, x fleet capacity")
    p = sub.add_parser("slow", parents=[common])
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--load", type=float, default=0.5, help="offered, x the healthy fleet's capacity")
    p.add_argument("--slowdown", type=float, default=10.0, help="the slow worker's cost multiplier")
    p = sub.add_parser("autoscale", parents=[common])
    p.add_argument("--before", type=float, default=15.0, help="seconds at --low before the step")
    p.add_argument("--step", type=float, default=30.0, help="seconds at --high")
    p.add_argument("--after", type=float, default=45.0, help="seconds back at --low")
    p.add_argument("--low", type=float, default=0.2, help="offered, x one worker's capacity")
    p.add_argument("--high", type=float, default=1.5, help="offered, x one worker's capacity")
    p.add_argument("--max-workers", type=int, default=AUTOSCALE["max_workers"])
    p.add_argument("--poll-s", type=float, default=0.5, help="GET /admin/workers period")
    p.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    interrupt_on(signal.SIGTERM)
    fn = {
        "scaling": cmd_scaling,
        "priorities": cmd_priorities,
        "slow": cmd_slow,
        "rolling": cmd_rolling,
        "drain": cmd_drain,
        "autoscale": cmd_autoscale,
    }
    out = fn[args.cmd](args)
    out["command"] = " ".join([".venv/bin/python", "benchmarks/fleet.py", *sys.argv[1:]])
    out["loadavg_end"] = os.getloadavg()
    print(f"JSON: {write_json(OUT_DIR / f'fleet_{args.cmd}.json', out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
