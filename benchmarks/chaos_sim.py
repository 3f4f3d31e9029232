"""Failure testing of worker processes: `inferd bench --chaos kill` against a real `inferd serve`.

Starts `inferd serve` itself, serving only `sim` with base_ms=100, per_item_ms=1 and 2 workers (each worker
tops out near 500 req/s at full batches, so losing one at the default 800 req/s builds a queue until it is
replaced), waits for /v2/health/ready, then offers open-loop load while SIGKILLing (or SIGSTOPping) a
random ready worker every --interval seconds. Prints the report (invariants, throughput, latency, time to
detect and to replace, p99 after injections vs steady), writes it as JSON to --json-out, and always stops
the server: SIGTERM, then SIGKILL of its whole process group after --grace seconds.

    python benchmarks/chaos_sim.py [--rate 800] [--duration 60] [--interval 3] [--chaos kill|stop]

Exits 1 when an answer was misrouted or duplicated, 2 when the server could not be started.
Set INFERD_ADMIN_TOKEN to run the server's admin API with a token (the tool sends it too).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from inferd.bench.chaos import ChaosSpec
from inferd.bench.loadgen import LoadSpec, run_load_blocking
from inferd.bench.report import render

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """\
[server]
workers = 2
admin_host = "127.0.0.1"
admin_port = {admin_port}

[models.sim.params]
base_ms = 100.0
per_item_ms = 1.0
"""


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_server(port: int, admin_port: int, config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    config.write_text(CONFIG.format(admin_port=admin_port))
    cmd = [sys.executable, "-m", "inferd.cli.main", "serve", "--config", str(config)]
    cmd += ["--model", "sim", "--port", str(port)]
    with open(log_path, "wb") as log:
        # Its own process group, so a last-resort SIGKILL reaches the workers too.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not ready within {timeout_s:g} s")


def stop_server(proc: subprocess.Popen[bytes], grace_s: float) -> str:
    """SIGTERM, wait up to grace_s, then SIGKILL the process group; returns what happened."""
    how = "had already exited"
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
            how = f"stopped on SIGTERM (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            how = f"did not stop within {grace_s:g} s of SIGTERM: SIGKILLed"
    try:  # whatever is left of the group (workers of a killed server), and reap the server
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    return how


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rate", type=float, default=800.0, help="offered req/s (open loop)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the measured window")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before it")
    parser.add_argument("--chaos", choices=("kill", "stop", "none"), default="kill")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between injections")
    parser.add_argument("--timeout-ms", type=float, default=5000.0, help="client deadline per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--admin-port", type=int, default=8001)
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for ready")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds from SIGTERM to SIGKILL")
    parser.add_argument("--json-out", type=Path, default=ROOT / ".bench" / "chaos_sim.json")
    args = parser.parse_args()

    busy = [p for p in (args.port, args.admin_port) if not _port_free(p)]
    if busy:
        print(f"error: port(s) {busy} already in use; stop that server or pass --port/--admin-port")
        return 2
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.json_out.with_name("chaos_sim_server.log")
    url = f"http://127.0.0.1:{args.port}"
    load = LoadSpec(
        url=url,
        model="sim",
        rate=args.rate,
        duration_s=args.duration,
        warmup_s=args.warmup,
        timeout_ms=args.timeout_ms,
        seed=args.seed,
    )
    chaos = ChaosSpec(
        mode=args.chaos,
        interval_s=args.interval,
        admin_url=f"http://127.0.0.1:{args.admin_port}",
        admin_token=os.environ.get("INFERD_ADMIN_TOKEN") or None,
        seed=args.seed,
    )
    # SIGTERM to this script unwinds like Ctrl-C, so the server is stopped and stopped pids resumed.
    signal.signal(signal.SIGTERM, _interrupt)
    with tempfile.TemporaryDirectory(prefix="chaos_sim.") as tmp:
        t = time.monotonic()
        proc = start_server(args.port, args.admin_port, Path(tmp) / "inferd.toml", log_path)
        try:
            try:
                wait_ready(proc, url, args.ready_timeout)
            except RuntimeError as exc:
                print(f"error: {exc}; server log: {log_path}")
                return 2
            print(
                f"server ready after {time.monotonic() - t:.1f} s (pid {proc.pid}, log {log_path}); "
                f"{args.rate:g} req/s for {args.warmup:g}+{args.duration:g} s, chaos {args.chaos} "
                f"every {args.interval:g} s",
                flush=True,
            )
            report = run_load_blocking(load, chaos)
        finally:
            print(f"server {stop_server(proc, args.grace)}", flush=True)
    render(report)
    args.json_out.write_text(json.dumps(report.to_dict(), indent=2))
    print(f"JSON report: {args.json_out}")
    return 1 if report.mismatched_total > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
