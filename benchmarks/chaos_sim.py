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
import os
import signal
import sys
from pathlib import Path

from harness import OUT_DIR, InferdServer, ServerNotReady, interrupt_on, port_free, write_json

from inferd.bench.chaos_spec import ChaosSpec
from inferd.bench.loadgen import LoadSpec, run_load_blocking
from inferd.bench.report import render

CONFIG = """\
[server]
workers = 2
admin_host = "127.0.0.1"
admin_port = {admin_port}

[models.sim.params]
base_ms = 100.0
per_item_ms = 1.0
"""


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
    parser.add_argument("--admin-port", type=int, default=8002)
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for ready")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds from SIGTERM to SIGKILL")
    parser.add_argument("--json-out", type=Path, default=OUT_DIR / "chaos_sim.json")
    args = parser.parse_args()

    busy = [p for p in (args.port, args.admin_port) if not port_free(p)]
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
    interrupt_on(signal.SIGTERM)
    server = InferdServer(
        "--model",
        "sim",
        name="chaos_sim",
        config=CONFIG.format(admin_port=args.admin_port),
        port=args.port,
        log_path=log_path,
        ready_timeout_s=args.ready_timeout,
        grace_s=args.grace,
    )
    try:
        with server:
            print(
                f"server ready after {server.ready_s:.1f} s (pid {server.pid}, log {log_path}); "
                f"{args.rate:g} req/s for {args.warmup:g}+{args.duration:g} s, chaos {args.chaos} "
                f"every {args.interval:g} s",
                flush=True,
            )
            report = run_load_blocking(load, chaos)
    except ServerNotReady as exc:
        print(f"error: {exc}")
        return 2
    finally:
        if server.stopped is not None:
            print(f"server {server.stopped.how}", flush=True)
    render(report)
    write_json(args.json_out, report.to_dict(), indent=2)
    print(f"JSON report: {args.json_out}")
    return 1 if report.mismatched_total > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
