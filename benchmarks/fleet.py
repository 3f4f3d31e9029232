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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from inferd.bench.loadgen import LoadSpec, _loop_factory, run_load, run_load_blocking
from inferd.bench.report import LoadReport

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / ".bench"
TICK = os.sysconf("SC_CLK_TCK")
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`inferd serve` on a temporary model repository holding sim (version 1) with `workers` workers."""

    def __init__(self, workers: int, name: str) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix=f"fleet_{name}.")
        base = Path(self.tmp.name)
        self.repo = base / "models"
        (self.repo / "sim" / "1").mkdir(parents=True)
        (self.repo / "sim" / "model.toml").write_text(MODEL_TOML.format(workers=workers))
        self.port, self.admin_port = free_port(), free_port()
        config = base / "inferd.toml"
        config.write_text(SERVER_TOML.format(admin_port=self.admin_port))
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        OUT_DIR.mkdir(exist_ok=True)
        self.log_path = OUT_DIR / f"fleet_{name}_server.log"
        cmd = [sys.executable, "-m", "inferd.cli.main", "serve", "--config", str(config)]
        cmd += ["--model-repo", str(self.repo), "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )
        self.workers = workers

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                if len(self.ready_workers()) >= self.workers:
                    with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=1) as r:
                        if r.status == 200:
                            return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready within {timeout_s:g} s; log: {self.log_path}")

    def admin_call(self, method: str, path: str, timeout: float = 120.0) -> Any:
        req = urllib.request.Request(
            f"{self.admin}{path}", method=method, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def ready_workers(self) -> list[dict[str, Any]]:
        rows = self.admin_call("GET", "/admin/workers", timeout=2)["workers"]
        return [w for w in rows if w["model"] == "sim" and w["state"] == "ready"]

    def pids(self) -> list[int]:
        """The server and every descendant (workers)."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            ps = subprocess.run(
                ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
            )
            todo += [int(x) for x in ps.stdout.split()]
        return out

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.tmp.cleanup()

    def __enter__(self) -> Server:
        try:
            t = self.wait_ready()
        except BaseException:
            self.stop()
            raise
        print(
            f"server ready in {t:.1f} s ({self.workers} worker(s), {self.url}, admin {self.admin})",
            flush=True,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / TICK


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


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


def write(name: str, data: dict[str, Any]) -> Path:
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / f"fleet_{name}.json"
    path.write_text(json.dumps(data, indent=1))
    print(f"JSON: {path}")
    return path


def p99(r: dict[str, Any]) -> float | None:
    return r["latency_ms"].get("p99")


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


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
                pids = srv.pids()
                c0 = cpu_s(pids)
                report = run_load_blocking(spec(srv.url, rate, args))
                c1 = cpu_s(pids)
                r = summary(report) | {"workers": n, "fraction": f, "rate": rate}
                r["server_cpu_us_per_request"] = round(1e6 * (c1 - c0) / max(1, report.sent), 1)
                runs[n].append(r)
                print(
                    f"  N={n} offered {rate:g}: achieved {r['achieved']:g}, p99 {_fmt(p99(r))} ms, "
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
    print(f"\np99 bound (2x single-worker sustained p99): {_fmt(bound)} ms\n")
    print(
        "| workers | offered req/s | achieved | p50 ms | p99 ms | errors | mean batch | server CPU us/req |"
    )
    print("|---:|---:|---:|---:|---:|---|---:|---:|")
    for n, rs in runs.items():
        for r in rs:
            errs = sum(r["errors"].values())
            print(
                f"| {n} | {r['rate']:,.0f} | {r['achieved']:,.0f} | {_fmt(r['latency_ms'].get('p50'))} | "
                f"{_fmt(p99(r))} | {errs or 0} | {_fmt(r['batch_mean'])} | {r['server_cpu_us_per_request']:.0f} |"
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
            f"| {n} | {_fmt(s['rate'] if s else None, 0)} | {_fmt(p99(s) if s else None)} | "
            f"{_fmt(lin, 2)} | {_fmt(s['server_cpu_us_per_request'] if s else None, 0)} |"
        )
    return out


def cmd_priorities(args: argparse.Namespace) -> dict[str, Any]:
    n = 2
    capacity = PER_WORKER_RPS * n
    bulk_rate, inter_rate = args.bulk_factor * capacity, args.interactive_share * capacity
    with Server(n, "priorities") as srv:
        alone = run_load_blocking(spec(srv.url, inter_rate, args, priority="interactive", seed=1))
        print(f"  interactive alone: p99 {_fmt(alone.measured.latency_ms.get('p99'))} ms", flush=True)

        async def both() -> tuple[LoadReport, LoadReport]:
            return await asyncio.gather(
                run_load(spec(srv.url, bulk_rate, args, priority="bulk", seed=2)),
                run_load(spec(srv.url, inter_rate, args, priority="interactive", seed=3)),
            )

        pids = srv.pids()
        c0 = cpu_s(pids)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            bulk, inter = runner.run(both())
        c1 = cpu_s(pids)
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
        "server_cpu_us_per_request": round(1e6 * (c1 - c0) / max(1, bulk.sent + inter.sent), 1),
    }
    print(
        f"\n2 workers (capacity {capacity:,.0f} req/s), bulk offered {bulk_rate:,.0f}, interactive {inter_rate:,.0f}\n"
    )
    print("| run | offered req/s | achieved | p50 ms | p99 ms | errors |")
    print("|---|---:|---:|---:|---:|---|")
    for label, r in (("interactive alone", a), ("interactive with bulk", i), ("bulk", b)):
        print(
            f"| {label} | {r['offered']:,.0f} | {r['achieved']:,.0f} | {_fmt(r['latency_ms'].get('p50'))} | "
            f"{_fmt(p99(r))} | {r['errors'] or 0} |"
        )
    print(f"\ninteractive p99 with bulk / alone: {_fmt(ratio, 2)}x (target <= 1.5x)")
    print(
        f"bulk goodput {b['achieved']:,.0f} req/s of {spare:,.0f} spare: {_fmt(100 * bulk_share if bulk_share else None, 0)}% "
        "(target >= 80%)"
    )
    return out


def _mid_run_action(srv: Server, at_s: float, action: Any, result: dict[str, Any]) -> threading.Thread:
    def go() -> None:
        time.sleep(at_s)
        try:
            result.update(action())
        except Exception as exc:  # reported, not fatal to the load run
            result["error"] = repr(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


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
        f"| {label} | {r['offered']:,.0f} | {r['achieved']:,.0f} | {_fmt(r['latency_ms'].get('p50'))} | "
        f"{_fmt(p99(r))} | {inv['lost']} | {inv['duplicated']} | {inv['misrouted']} | "
        f"{inv['errors'] or 0} (failed in window: {failed}) |"
    )


def cmd_rolling(args: argparse.Namespace) -> dict[str, Any]:
    n = 2
    rate = args.load * PER_WORKER_RPS * n
    result: dict[str, Any] = {}
    with Server(n, "rolling") as srv:
        before = srv.ready_workers()

        def update() -> dict[str, Any]:
            (srv.repo / "sim" / "2").mkdir()
            t = time.monotonic()
            answer = srv.admin_call("POST", "/admin/models/sim/update", timeout=120)
            return {"update_s": round(time.monotonic() - t, 3), "answer": answer}

        at = args.warmup + args.duration / 2
        th = _mid_run_action(srv, at, update, result)
        report = run_load_blocking(spec(srv.url, rate, args, seed=7))
        th.join(120)
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
    result: dict[str, Any] = {}
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

        at = args.warmup + args.duration / 2
        th = _mid_run_action(srv, at, drain, result)
        report = run_load_blocking(spec(srv.url, rate, args, seed=9))
        th.join(60)
        after = srv.ready_workers()
    r = summary(report)
    out = {"rate": rate, "drain_at_s": at, "drain": result, "load": r, "workers_after": after}
    print(f"\n2 workers, {rate:,.0f} req/s, drain one worker at t={at:g} s (from load start)\n")
    _invariants_table("drain", r)
    print(f"\ndrain: {result}")
    return out


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
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    fn = {"scaling": cmd_scaling, "priorities": cmd_priorities, "rolling": cmd_rolling, "drain": cmd_drain}
    out = fn[args.cmd](args)
    out["command"] = " ".join([".venv/bin/python", "benchmarks/fleet.py", *sys.argv[1:]])
    out["loadavg_end"] = os.getloadavg()
    write(args.cmd, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
