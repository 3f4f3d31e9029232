"""Soak: `inferd serve` under steady open-loop load for a long time, with a worker SIGKILLed every
--chaos-interval seconds, while the front end's resident memory, open fds and threads (and its
workers') are sampled every --sample-every seconds.

The configuration is light on CPU (the device is a sleep): `sim` at 200 ms + 1 ms per item, batches of
at most 20, 2 workers, so about 2 x 20 / 0.22 s = 180 req/s at full batches. First measure what it
sustains (a step test, no chaos), then soak at 70% of that:

    .venv/bin/python benchmarks/soak.py capacity [--rates 100,140,160,180,200] [--duration 20]
    .venv/bin/python benchmarks/soak.py run --capacity 180 [--load 0.7] [--duration 1800]

`run` offers load with `inferd bench --chaos kill` (a separate process, so the load generator's work is
not the sampled processes'), and passes when:

* resident memory of the front end is flat: the mean over the --rss-window seconds after --rss-warmup
  grew by at most 5% by the last --rss-window seconds of the run;
* the checker counted 0 lost, 0 duplicated and 0 misrouted answers over the whole run.

It also reports the success ratio, latency, 503s (a killed batch whose callers' retry budget is spent),
kills and worker replacements (`inferd_worker_restarts_total`), and writes every sample and the bench
report to .bench/soak.json. Exits 0 on pass, 1 on fail, 2 when the server could not be started.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from harness import (
    OUT_DIR,
    InferdServer,
    ServerNotReady,
    cell,
    free_port,
    inferd_command,
    interrupt_on,
    write_json,
)
from procfs import rss_mib_by_pid

CONFIG = """\
[server]
workers = 2
admin_host = "127.0.0.1"
admin_port = {admin_port}

[models.sim]
max_batch_size = 20
max_queue_size = 400

[models.sim.params]
base_ms = 200.0
per_item_ms = 1.0
"""
RSS_GROWTH_LIMIT = 0.05


def start_server(log_name: str) -> tuple[InferdServer, str]:
    """The soak configuration's server (not yet started) and its admin URL."""
    admin_port = free_port()
    server = InferdServer(
        "--model",
        "sim",
        "--log-level",
        "WARNING",
        name="soak",
        config=CONFIG.format(admin_port=admin_port),
        log_path=OUT_DIR / log_name,
        ready_timeout_s=120.0,
        grace_s=30.0,
    )
    return server, f"http://127.0.0.1:{admin_port}"


# --- what is sampled ---


def _threads(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _fds(pid: int) -> int | None:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return None


def sample(server: InferdServer, t_s: float) -> dict[str, Any]:
    """One reading: the front end's RSS (MiB), fds and threads; its other processes (the workers)
    counted and summed."""
    pids = server.pids()
    front = server.pid
    others = sorted(pids - {front})
    rss = rss_mib_by_pid([front, *others])
    return {
        "t_s": round(t_s, 1),
        "rss_mib": round(rss.get(front, 0.0), 2),
        "fds": _fds(front),
        "threads": _threads(front),
        "workers": len(others),
        "workers_rss_mib": round(sum(rss.get(p, 0.0) for p in others), 1),
        "workers_fds": sum(_fds(p) or 0 for p in others),
        "workers_threads": sum(_threads(p) or 0 for p in others),
    }


class Sampler(threading.Thread):
    """`sample()` every `every_s` from `start()` until `finish()`; times are from `t0`."""

    def __init__(self, server: InferdServer, every_s: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.server, self.every_s, self.t0 = server, every_s, t0
        self.samples: list[dict[str, Any]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while True:
            self.samples.append(sample(self.server, time.monotonic() - self.t0))
            if self._done.wait(self.every_s):
                return

    def finish(self) -> list[dict[str, Any]]:
        self._done.set()
        self.join()
        return self.samples


# --- load ---


def bench(url: str, admin_url: str, args: argparse.Namespace, rate: float, chaos: bool) -> dict[str, Any]:
    """`inferd bench --json` at `rate` for args.warmup + args.duration seconds; its report."""
    options = [
        *("--url", url, "--model", "sim", "--rate", f"{rate:g}"),
        *("--duration", f"{args.duration:g}", "--warmup", f"{args.warmup:g}"),
        *("--timeout-ms", f"{args.timeout_ms:g}", "--seed", str(args.seed), "--json"),
    ]
    if chaos:
        options += ["--chaos", "kill", "--chaos-interval", f"{args.chaos_interval:g}"]
        options += ["--admin-url", admin_url]
    bound_s = args.warmup + args.duration + args.timeout_ms / 1000.0 + 120.0
    done = subprocess.run(
        inferd_command("bench", *options), capture_output=True, text=True, timeout=bound_s, check=False
    )
    if done.returncode not in (0, 1):  # 1: a mismatch, still reported
        raise RuntimeError(f"inferd bench exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def worker_restarts(url: str) -> float:
    """inferd_worker_restarts_total over every model, from the server's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5.0) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inferd_worker_restarts_total")
    )


# --- capacity ---


def capacity(args: argparse.Namespace) -> int:
    """Each rate for --warmup + --duration s, no chaos; the highest that sustained (no errors,
    >= 95% achieved, p99 <= --slo-ms)."""
    server, admin_url = start_server("soak_capacity_server.log")
    rows = []
    with server:
        for rate in [float(r) for r in args.rates.split(",")]:
            m = bench(server.url, admin_url, args, rate, chaos=False)["measured"]
            p99 = m["latency_ms"]["p99"]
            ok = (
                not m["errors"]
                and m["achieved_rps"] >= 0.95 * m["offered_rps"]
                and p99 is not None
                and p99 <= args.slo_ms
            )
            rows.append((rate, m, ok))
            print(
                f"{rate:g} req/s: achieved {m['achieved_rps']:.1f}, p99 {p99}, errors {m['errors']}",
                flush=True,
            )
    print("\n| offered req/s | achieved req/s | p50 ms | p99 ms | errors | mean batch | sustained |")
    print("|---:|---:|---:|---:|---|---:|---|")
    for rate, m, ok in rows:
        lat = m["latency_ms"]
        errors = ", ".join(f"{k} {v}" for k, v in m["errors"].items()) or "0"
        print(
            f"| {rate:g} | {m['achieved_rps']:.1f} | {cell(lat['p50'], 0)} | {cell(lat['p99'], 0)} | "
            f"{errors} | {cell(m['batch_size']['mean'])} | {'yes' if ok else 'no'} |"
        )
    best = max((rate for rate, _, ok in rows if ok), default=0.0)
    print(f"\ncapacity (no errors, >= 95% achieved, p99 <= {args.slo_ms:g} ms): {best:g} req/s")
    write_json(OUT_DIR / "soak_capacity.json", {"command": " ".join(sys.argv), "rows": rows})
    return 0 if best else 1


# --- soak ---


def _mean(samples: list[dict[str, Any]], key: str, lo: float, hi: float) -> float | None:
    values = [s[key] for s in samples if lo <= s["t_s"] < hi and s[key] is not None]
    return statistics.fmean(values) if values else None


def rss_verdict(samples: list[dict[str, Any]], warmup_s: float, window_s: float) -> dict[str, Any]:
    """Mean RSS (and fds, threads) of the first window after warm-up vs the last window."""
    end = samples[-1]["t_s"] + 1e-9
    first = (warmup_s, warmup_s + window_s)
    last = (max(first[1], end - window_s), end)
    out: dict[str, Any] = {"first_window_s": first, "last_window_s": last}
    for key in ("rss_mib", "fds", "threads", "workers_rss_mib"):
        a, b = _mean(samples, key, *first), _mean(samples, key, *last)
        out[key] = {"first": a, "last": b, "growth": None if not a or b is None else b / a - 1}
    growth = out["rss_mib"]["growth"]
    out["flat"] = growth is not None and growth <= RSS_GROWTH_LIMIT
    return out


def soak(args: argparse.Namespace) -> int:
    rate = args.rate or args.load * args.capacity
    server, admin_url = start_server("soak_server.log")
    with server:
        print(
            f"server ready after {server.ready_s:.1f} s (pid {server.pid}); {rate:g} req/s for "
            f"{args.warmup:g}+{args.duration:g} s, a worker SIGKILLed every {args.chaos_interval:g} s",
            flush=True,
        )
        restarts_before = worker_restarts(server.url)
        sampler = Sampler(server, args.sample_every, time.monotonic())
        sampler.start()
        try:
            report = bench(server.url, admin_url, args, rate, chaos=True)
        finally:
            samples = sampler.finish()
        restarts = worker_restarts(server.url) - restarts_before
    verdict = rss_verdict(samples, args.rss_warmup, args.rss_window)
    result = {
        "command": " ".join(sys.argv),
        "rate": rate,
        "worker_restarts": restarts,
        "verdict": verdict,
        "samples": samples,
        "bench": report,
        "server_stop": server.stopped.how if server.stopped else None,
    }
    write_json(OUT_DIR / args.json_name, result)
    return print_soak(result, args.table_every)


def print_samples(samples: list[dict[str, Any]], every_s: float) -> None:
    print("| t s | front-end RSS MiB | fds | threads | workers | workers' RSS MiB | workers' fds |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    next_t = 0.0
    for i, s in enumerate(samples):
        if s["t_s"] >= next_t or i == len(samples) - 1:
            print(
                f"| {s['t_s']:.0f} | {s['rss_mib']:.1f} | {s['fds']} | {s['threads']} | {s['workers']} | "
                f"{s['workers_rss_mib']:.1f} | {s['workers_fds']} |"
            )
            next_t = s["t_s"] + every_s


def print_soak(result: dict[str, Any], table_every: float) -> int:
    report, verdict = result["bench"], result["verdict"]
    inv, m, chaos = report["invariants"], report["measured"], report["chaos"]
    print_samples(result["samples"], table_every)
    print()
    for key in ("rss_mib", "fds", "threads", "workers_rss_mib"):
        v = verdict[key]
        growth = "-" if v["growth"] is None else f"{100 * v['growth']:+.1f}%"
        print(
            f"{key}: first window mean {cell(v['first'], 2)}, last window mean {cell(v['last'], 2)} ({growth})"
        )
    lat = m["latency_ms"]
    print(
        f"offered {m['offered_rps']:.1f} req/s, {m['sent']:,} sent in the measured window, {m['ok']:,} ok "
        f"(success {m['ok'] / max(1, m['sent']):.4%}); latency p50 {cell(lat['p50'])} ms, p99 "
        f"{cell(lat['p99'])} ms, max {cell(lat['max'])} ms; retried {m['retried']:,}"
    )
    print(f"errors (whole run): {inv['errors'] or 'none'}; 503s {inv['errors'].get('http_503', 0)}")
    replace = chaos["replace_ms"]
    print(
        f"kills {len(chaos['injections'])} of {chaos['planned']} planned (skipped {chaos['skipped'] or 'none'}); "
        f"worker restarts {result['worker_restarts']:g}; time to replace ms p50 {cell(replace['p50'], 0)}, "
        f"max {cell(replace['max'], 0)}, not measured {replace['missing']}"
    )
    clean = inv["lost"] == 0 and inv["duplicated"] == 0 and inv["misrouted"] == 0
    print(
        f"PASS criteria: RSS growth <= {RSS_GROWTH_LIMIT:.0%}: {'PASS' if verdict['flat'] else 'FAIL'}; "
        f"lost {inv['lost']}, duplicated {inv['duplicated']}, misrouted {inv['misrouted']}: "
        f"{'PASS' if clean else 'FAIL'}"
    )
    print(f"server {result['server_stop']}; JSON: {OUT_DIR}/")
    return 0 if verdict["flat"] and clean else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    cap = sub.add_parser("capacity", help="step test without chaos")
    cap.add_argument("--rates", default="100,140,160,180,200")
    cap.add_argument("--duration", type=float, default=20.0)
    cap.add_argument("--warmup", type=float, default=5.0)
    cap.add_argument("--slo-ms", type=float, default=1000.0)
    run = sub.add_parser("run", help="the soak")
    run.add_argument("--capacity", type=float, default=180.0, help="req/s the step test sustained")
    run.add_argument("--load", type=float, default=0.7, help="fraction of --capacity offered")
    run.add_argument("--rate", type=float, default=None, help="req/s offered (overrides --load)")
    run.add_argument("--duration", type=float, default=1800.0, help="seconds of the measured window")
    run.add_argument("--warmup", type=float, default=10.0, help="seconds of load before it (no kills)")
    run.add_argument("--chaos-interval", type=float, default=10.0)
    run.add_argument("--sample-every", type=float, default=5.0)
    run.add_argument("--rss-warmup", type=float, default=300.0, help="seconds from the start of the load")
    run.add_argument("--rss-window", type=float, default=120.0)
    run.add_argument("--table-every", type=float, default=120.0, help="seconds between printed samples")
    run.add_argument("--json-name", default="soak.json")
    for p in (cap, run):
        p.add_argument("--timeout-ms", type=float, default=5000.0)
        p.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    interrupt_on(signal.SIGTERM)  # unwind like Ctrl-C: the server and the bench process are stopped
    try:
        return capacity(args) if args.mode == "capacity" else soak(args)
    except ServerNotReady as exc:
        print(f"error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
