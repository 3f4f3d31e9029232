"""inferd vs LitServe vs Ray Serve on the same simulated device, same load tool, same run, same rule.

    .venv/bin/python benchmarks/compare_peers.py [--systems inferd,litserve,rayserve] [--repeats 3]
        [--duration 10] [--warmup 2] [--slo-ms 200] [--rates 250,500,...] [--rates rayserve=50,100,...]

Each peer gets its own virtualenv under .bench/venvs/ (git-ignored), built with `python3 -m venv` and
pip-installed with pinned versions; they are NOT inferd dependencies:

    litserve==0.2.19        (.bench/venvs/litserve; fastapi 0.165.0, uvicorn 0.54.0, pyzmq 27.3.0)
    ray[serve]==2.60.0      (.bench/venvs/rayserve)

The servers (one at a time, so an idle one never competes for the 2 cores):

    inferd    .venv/bin/python -m inferd.cli.main serve --model sim --host 127.0.0.1 --port P --no-access-log
              --no-grpc --admin-port 0
    litserve  .bench/venvs/litserve/bin/python benchmarks/peers/litserve_sim.py --port P
    rayserve  .bench/venvs/rayserve/bin/python benchmarks/peers/rayserve_sim.py --port P

All three serve the same device: a batch of n costs 20 ms + 0.1 ms x n of wall time, one batch at a time,
batches of at most 100 and a 10 ms batch wait; all answer OIP v2 JSON on /v2/models/sim/infer, and
`inferd bench` (Python API, this venv, Poisson arrivals, raw client) checks every answer.

For each system, a ladder of offered rates; at each rate `--repeats` runs of `--warmup` s (excluded)
plus `--duration` s (measured). A run passes when it has no errors and no mismatches (warm-up
included for mismatches), achieved >= 90% of the offered rate, and p99 <= --slo-ms. A rate passes when
the medians over its repeats pass (median errors 0, median achieved >= 90%, median p99 <= SLO) and no
repeat had a mismatch. A system's ladder stops at its first failing rate; its sustained rate is the
highest passing rate below that.

Per run it records offered/achieved, errors by kind, mismatches, p50/p99, the server's CPU seconds
per request (utime+stime from /proc/PID/stat, summed over every process of the server's session and
its descendants, before/after the whole run, divided by the requests sent in warm-up plus measured
window), the server's RSS (summed over those processes, sampled every 0.5 s, peak; shared pages are
counted once per process), the load tool's own CPU per request, and the CPU the rest of the machine
used meanwhile ("other", from /proc/stat: other engineers' jobs, the kernel), so noise shows.

Writes .bench/compare_peers.json and prints a markdown table. Every server started is stopped at the
end, on errors and on Ctrl-C too (SIGTERM to the server, then to every remaining process of its
session, then SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

from harness import OUT_DIR, ROOT, ServerProcess, cell, free_port, inferd_command, interrupt_on, write_json
from procfs import RssSampler, cpu_seconds_since, cpu_ticks, machine_busy_s, rss_mib

from inferd.bench.loadgen import LoadSpec, run_load_blocking
from inferd.models.sim import sim_digest

VENVS = OUT_DIR / "venvs"
LOGS = OUT_DIR / "logs"
OUT_JSON = OUT_DIR / "compare_peers.json"

SYSTEMS = ("inferd", "litserve", "rayserve")
PEER_PINS = {
    "litserve": {"dist": "litserve", "version": "0.2.19", "pins": ["litserve==0.2.19"]},
    "rayserve": {"dist": "ray", "version": "2.60.0", "pins": ["ray[serve]==2.60.0"]},
}
DEFAULT_RATES = {
    "inferd": [250, 500, 1000, 1500, 2000, 2500, 3000, 3500],
    "litserve": [250, 500, 1000, 1500, 2000, 2500, 3000, 3500],
    # Ray Serve was measured near 50 req/s on this machine before: start lower so it gets a number.
    "rayserve": [50, 100, 250, 500, 1000, 1500, 2000, 2500, 3000, 3500],
}
READY_TIMEOUT_S = 180.0


# --- servers --------------------------------------------------------------------------------------


class SimServer(ServerProcess):
    """One system serving sim on 127.0.0.1:`port`; ready once it answers a real request correctly."""

    def __init__(self, system: str, cmd: list[str], port: int, env: dict[str, str] | None = None) -> None:
        super().__init__(
            cmd,
            name=system,
            log_path=LOGS / f"{system}.log",
            env={"PYTHONUNBUFFERED": "1", **(env or {})},
            ready_timeout_s=READY_TIMEOUT_S,
            poll_s=0.5,
            grace_s=20.0,
        )
        self.system = system
        self.url = f"http://127.0.0.1:{port}"

    def ready(self) -> bool:
        payload = "ready-check"
        body = json.dumps(
            {
                "id": "ready",
                "inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [payload]}],
            }
        ).encode()
        req = urllib.request.Request(
            self.url + "/v2/models/sim/infer", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            answer = json.loads(resp.read())
        if answer.get("id") == "ready" and answer["outputs"][0]["data"][0] == sim_digest("sim", 1, payload):
            return True
        raise ValueError(f"wrong answer {answer}")


# --- virtualenvs ----------------------------------------------------------------------------------


def venv_python(system: str) -> Path:
    return VENVS / system / "bin" / "python"


def installed_version(python: Path, dist: str) -> str | None:
    if not python.exists():
        return None
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    res = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return res.stdout.strip() if res.returncode == 0 else None


def ensure_venv(system: str) -> str:
    pin = PEER_PINS[system]
    python = venv_python(system)
    version = installed_version(python, pin["dist"])
    if version == pin["version"]:
        return version
    print(
        f"[{system}] creating {python.parent.parent} and installing {' '.join(pin['pins'])} ...", flush=True
    )
    if not python.exists():
        subprocess.run(["python3", "-m", "venv", str(VENVS / system)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pin["pins"]], check=True)
    version = installed_version(python, pin["dist"])
    if version != pin["version"]:
        raise RuntimeError(f"{system}: installed {pin['dist']} {version}, wanted {pin['version']}")
    return version


def make_server(system: str, port: int) -> SimServer:
    if system == "inferd":
        serve = ["--model", "sim", "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--no-grpc"]
        serve += ["--admin-port", "0"]  # the peers serve HTTP only; nothing on the HTTP port + 1 or + 2
        return SimServer(system, inferd_command("serve", *serve, "--log-level", "WARNING"), port)
    script = (
        ROOT / "benchmarks" / "peers" / ("litserve_sim.py" if system == "litserve" else "rayserve_sim.py")
    )
    cmd = [str(venv_python(system)), str(script), "--host", "127.0.0.1", "--port", str(port)]
    env = {"RAY_USAGE_STATS_ENABLED": "0"} if system == "rayserve" else {}
    return SimServer(system, cmd, port, env=env)


def system_version(system: str) -> str:
    if system == "inferd":
        return metadata.version("inferd")
    return installed_version(venv_python(system), PEER_PINS[system]["dist"]) or "?"


# --- runs -----------------------------------------------------------------------------------------


def one_run(server: SimServer, rate: float, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    spec = LoadSpec(
        url=server.url,
        model="sim",
        rate=rate,
        duration_s=args.duration,
        warmup_s=args.warmup,
        arrival="poisson",
        seed=seed,
        slo_ms=args.slo_ms,
    )
    pids = server.pids()
    before = cpu_ticks(pids)
    busy0 = machine_busy_s()
    load0 = os.getloadavg()[0]
    sampler = RssSampler(pids)
    sampler.start()
    t0 = time.monotonic()
    try:
        report = run_load_blocking(spec)
    finally:
        peak_rss = sampler.finish()
    wall = time.monotonic() - t0
    pids_after = server.pids()
    busy = machine_busy_s() - busy0
    server_cpu = cpu_seconds_since(before, pids_after)
    peak_rss = max(peak_rss, rss_mib(pids_after))
    m = report.measured
    sent = max(1, report.sent)
    errors = dict(m.errors)
    p99 = m.latency_ms["p99"]
    checks = {
        "no_errors": m.error_count == 0,
        "no_mismatches": report.mismatched_total == 0,
        "achieved_ge_90pct": m.achieved_rps >= 0.9 * rate,
        "p99_within_slo": p99 is not None and p99 <= args.slo_ms,
    }
    return {
        "rate": rate,
        "seed": seed,
        "offered_rps": m.offered_rps,
        "achieved_rps": m.achieved_rps,
        "goodput_rps": m.goodput_rps,
        "sent_measured": m.sent,
        "ok": m.ok,
        "errors": errors,
        "error_count": m.error_count,
        "mismatched": report.mismatched_total,
        "mismatch_kinds": m.mismatch_kinds,
        "latency_ms": m.latency_ms,
        "p50_ms": m.latency_ms["p50"],
        "p99_ms": p99,
        "batch_size": m.batch_size,
        "server_cpu_s": server_cpu,
        "server_cpu_ms_per_req": server_cpu * 1000.0 / sent,
        "server_cpu_cores": server_cpu / wall,
        "server_processes": len(pids_after),
        "server_rss_mib": peak_rss,
        "generator_cpu_s": report.generator_cpu_s,
        "generator_cpu_us_per_req": report.cpu_us_per_request,
        "other_cpu_cores": max(0.0, busy - server_cpu - report.generator_cpu_s) / wall,
        "machine_busy_cores": busy / wall,
        "loadavg_1m_before": load0,
        "wall_s": wall,
        "send_lag_p99_ms": m.send_lag_ms["p99"],
        "checks": checks,
        "passed": all(checks.values()),
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize_rung(rate: float, runs: list[dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    keys = (
        "offered_rps",
        "achieved_rps",
        "goodput_rps",
        "error_count",
        "p50_ms",
        "p99_ms",
        "server_cpu_ms_per_req",
        "server_cpu_cores",
        "server_rss_mib",
        "generator_cpu_us_per_req",
        "other_cpu_cores",
        "machine_busy_cores",
    )
    med = {k: _median([r[k] for r in runs]) for k in keys}
    errors: Counter[str] = Counter()
    for r in runs:
        errors.update(r["errors"])
    mismatched = sum(r["mismatched"] for r in runs)
    passed = (
        med["error_count"] == 0
        and mismatched == 0
        and med["achieved_rps"] is not None
        and med["achieved_rps"] >= 0.9 * rate
        and med["p99_ms"] is not None
        and med["p99_ms"] <= slo_ms
    )
    return {
        "rate": rate,
        "median": med,
        "errors_total": dict(sorted(errors.items())),
        "mismatched_total": mismatched,
        "runs_passed": sum(r["passed"] for r in runs),
        "passed": passed,
        "runs": runs,
    }


def bench_system(system: str, rates: list[float], args: argparse.Namespace) -> dict[str, Any]:
    version = system_version(system) if system == "inferd" else ensure_venv(system)
    server = make_server(system, free_port())
    result: dict[str, Any] = {"system": system, "version": version, "cmd": server.cmd, "rungs": []}
    print(f"\n[{system} {version}] starting: {' '.join(server.cmd)}", flush=True)
    server.start()
    try:
        result["ready_s"] = server.wait_ready()
        pids = server.pids()
        result["idle_processes"] = len(pids)
        result["idle_rss_mib"] = rss_mib(pids)
        print(
            f"[{system}] ready in {result['ready_s']:.1f} s; {len(pids)} processes, "
            f"{result['idle_rss_mib']:.0f} MiB RSS",
            flush=True,
        )
        for rate in rates:
            runs = []
            for rep in range(args.repeats):
                run = one_run(server, rate, args, seed=rep)
                runs.append(run)
                print(
                    f"[{system}] {rate:>6g} req/s rep {rep + 1}/{args.repeats}: achieved "
                    f"{run['achieved_rps']:7.1f}  errors {run['errors'] or 0}  mism {run['mismatched']}  "
                    f"p50 {cell(run['p50_ms'])}  p99 {cell(run['p99_ms'])} ms  "
                    f"cpu {run['server_cpu_ms_per_req']:.3f} ms/req  rss {run['server_rss_mib']:.0f} MiB  "
                    f"gen {run['generator_cpu_us_per_req']:.0f} us/req  other {run['other_cpu_cores']:.2f} cores"
                    f"  {'PASS' if run['passed'] else 'FAIL'}",
                    flush=True,
                )
                time.sleep(1.0)  # let a backlog drain before the next run
            rung = summarize_rung(rate, runs, args.slo_ms)
            result["rungs"].append(rung)
            if not rung["passed"]:
                print(f"[{system}] fails at {rate:g} req/s; ladder stops", flush=True)
                break
    except Exception as exc:  # one system failing must not lose the others' results
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{system}] ERROR {result['error']}", file=sys.stderr, flush=True)
    finally:
        result["sigkilled"] = server.stop().sigkilled
    passing = [r["rate"] for r in result["rungs"] if r["passed"]]
    result["sustained_rps"] = max(passing) if passing else None
    achieved = [r["median"]["achieved_rps"] for r in result["rungs"] if r["median"]["achieved_rps"]]
    result["peak_achieved_rps"] = max(achieved) if achieved else None
    return result


# --- output ---------------------------------------------------------------------------------------


def markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Sustained rate: highest offered rate with no errors, no mismatches, achieved >= 90% of offered "
        f"and p99 <= {args.slo_ms:g} ms (medians of {args.repeats} run(s) of {args.warmup:g} s warm-up + "
        f"{args.duration:g} s).",
        "",
        "| system | version | sustained req/s | peak achieved req/s | p99 ms @ sustained "
        "| server CPU ms/req @ sustained | server RSS MiB @ sustained |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        at = next((r for r in res["rungs"] if r["rate"] == res["sustained_rps"]), None)
        med = at["median"] if at else {}
        lines.append(
            f"| {res['system']} | {res['version']} | {cell(res['sustained_rps'], 0) if at else 'none'} "
            f"| {cell(res['peak_achieved_rps'])} | {cell(med.get('p99_ms'))} "
            f"| {cell(med.get('server_cpu_ms_per_req'), 3)} | {cell(med.get('server_rss_mib'), 0)} |"
        )
    lines += [
        "",
        "| system | offered | achieved | errors | mism. | p50 ms | p99 ms | server CPU ms/req "
        "| server cores | RSS MiB | gen CPU us/req | other cores | pass |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for res in results:
        for rung in res["rungs"]:
            med = rung["median"]
            errors = ", ".join(f"{k} {v}" for k, v in rung["errors_total"].items()) or "0"
            lines.append(
                f"| {res['system']} | {rung['rate']:g} | {cell(med['achieved_rps'])} | {errors} "
                f"| {rung['mismatched_total']} | {cell(med['p50_ms'])} | {cell(med['p99_ms'])} "
                f"| {cell(med['server_cpu_ms_per_req'], 3)} | {cell(med['server_cpu_cores'], 2)} "
                f"| {cell(med['server_rss_mib'], 0)} | {cell(med['generator_cpu_us_per_req'], 0)} "
                f"| {cell(med['other_cpu_cores'], 2)} | {'yes' if rung['passed'] else 'NO'} |"
            )
        if res.get("error"):
            lines.append(f"| {res['system']} | error: {res['error']} |||||||||||")
    return "\n".join(lines)


def parse_rates(values: list[str] | None, systems: list[str]) -> dict[str, list[float]]:
    rates = {s: [float(r) for r in DEFAULT_RATES[s]] for s in systems}
    for value in values or []:
        target, _, spec = value.rpartition("=")
        ladder = sorted(float(r) for r in spec.split(",") if r.strip())
        if not ladder or any(r <= 0 for r in ladder):
            raise SystemExit(f"bad --rates {value!r}")
        for s in [target] if target else systems:
            if s not in rates:
                raise SystemExit(f"--rates names unknown or unselected system {s!r}")
            rates[s] = ladder
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, in run order")
    parser.add_argument(
        "--rates",
        action="append",
        help="ladder 'R1,R2,...' for all systems, or 'SYSTEM=R1,R2,...' for one (repeatable)",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run (>= 10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per run, excluded")
    parser.add_argument("--repeats", type=int, default=3, help="runs per rate; medians are reported")
    parser.add_argument("--slo-ms", type=float, default=200.0, help="p99 bound for 'sustained'")
    parser.add_argument("--out", type=Path, default=OUT_JSON)
    args = parser.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.duration < 10:
        print("note: --duration below 10 s; runs are noisier than the 10 s minimum the rule assumes")
    rates = parse_rates(args.rates, systems)

    # Our own SIGINT handler too: asyncio.Runner (inside run_load_blocking) only turns the first Ctrl-C
    # into a cancellation of the load run, which it may absorb; raising here stops the whole comparison.
    interrupt_on(signal.SIGTERM, signal.SIGINT)
    started = time.time()
    results: list[dict[str, Any]] = []
    try:
        for system in systems:
            results.append(bench_system(system, rates[system], args))
    except KeyboardInterrupt:
        print("\ninterrupted; servers stopped", file=sys.stderr)
    doc = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "elapsed_s": time.time() - started,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {
            "systems": systems,
            "rates": rates,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "repeats": args.repeats,
            "slo_ms": args.slo_ms,
            "arrival": "poisson",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "loadavg_end": os.getloadavg(),
        },
        "results": results,
    }
    write_json(args.out, doc, indent=2)
    print()
    print(markdown(results, args))
    print(f"\nJSON: {args.out}")
    return 0 if len(results) == len(systems) else 130


if __name__ == "__main__":
    sys.exit(main())
