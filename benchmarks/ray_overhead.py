"""Per-batch overhead of workers launched as Ray actors (`inferd serve --ray`) against local worker
processes, on one machine:

* `local`: the embedded default, worker processes over a Unix socket;
* `tcp`: a worker joining over TCP loopback (`inferd worker --connect`), the transport Ray actors use;
* `ray`: two workers as Ray actors on a local Ray cluster that this script starts on loopback and stops.

The model is `sim` with no compute (base_ms = per_item_ms = 0) and no batching wait (max_wait_ms = 0), at a
low open-loop rate, so batches hold one request and the framework overhead (latency - queue wait -
compute) is the whole cost of a batch's trip; the difference between modes is what the launcher adds.
Batches travel over inferd's own protocol in every mode: no Ray call is made per batch.

    .venv/bin/python benchmarks/ray_overhead.py [--rate 50] [--duration 10] [--repeats 3]

Writes .bench/ray_overhead.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import (
    OUT_DIR,
    InferdServer,
    ServerProcess,
    free_port,
    http_ok,
    inferd_command,
    run_fields,
    write_json,
)
from procfs import processes_mentioning, rss_mib

from inferd.bench.loadgen import LoadSpec, run_load_blocking

BIN = Path(sys.executable).parent
CONFIG = """\
[models.sim]
max_wait_ms = 0.0

[models.sim.params]
base_ms = 0.0
per_item_ms = 0.0
"""
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep the throwaway cluster on loopback
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
TOKEN = "bench-join-token"


class SimServer(InferdServer):
    """Ready when the sim model is (its workers joined), not only the server."""

    def ready(self) -> bool:
        return http_ok(f"{self.url}/v2/models/sim/ready")


class RayCluster:
    """A one-node Ray cluster on loopback with 2 inferd_device units; stops only its own processes."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        port = free_port()
        t0 = time.monotonic()
        start = subprocess.run(
            [
                str(BIN / "ray"),
                "start",
                "--head",
                f"--port={port}",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=2",
                "--num-gpus=0",
                '--resources={"inferd_device": 2}',
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--temp-dir={self.temp_dir}",
            ],
            env={**os.environ, **RAY_ENV},
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
        if start.returncode != 0:
            raise SystemExit(f"ray start failed:\n{start.stdout}{start.stderr}")
        self.start_s = time.monotonic() - t0
        self.address = f"127.0.0.1:{port}"

    def pids(self) -> list[int]:
        """Processes whose command line names this cluster's temp dir, and their descendants."""
        return sorted(processes_mentioning(self.temp_dir))

    def stop(self) -> None:
        pids = self.pids()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def launch(mode: str, cluster: RayCluster | None) -> tuple[SimServer, list[ServerProcess]]:
    """The server for `mode`, and the workers to start beside it (tcp mode)."""
    serve = ["--model", "sim", "--no-admin", "--log-level", "WARNING"]
    env: dict[str, str] = {}
    workers: list[ServerProcess] = []
    if mode == "local":
        serve += ["--workers", "2"]
    elif mode == "tcp":
        worker_port = free_port()
        serve += ["--workers", "0", "--worker-port", str(worker_port)]
        env["INFERD_JOIN_TOKEN"] = TOKEN
        for i in range(2):
            worker = ["--connect", f"127.0.0.1:{worker_port}", "--model", "sim", "--worker-id", f"tcp-{i}"]
            worker += ["--log-level", "WARNING"]
            workers.append(
                ServerProcess(inferd_command("worker", *worker), name=f"tcp-{i}", env=env, grace_s=30)
            )
    else:
        assert cluster is not None
        serve += ["--workers", "2", "--ray", cluster.address]
        env.update(RAY_ENV)
    server = SimServer(*serve, name=f"ray_overhead_{mode}", config=CONFIG, env=env, poll_s=0.05, grace_s=60)
    return server, workers


def measure(mode: str, args: argparse.Namespace, cluster: RayCluster | None) -> dict:
    server, workers = launch(mode, cluster)
    server.start()
    try:
        for worker in workers:
            worker.start()
        ready_s = server.wait_ready()  # the sim model, once its workers joined
        runs = []
        for i in range(args.repeats):
            spec = LoadSpec(
                url=server.url,
                model="sim",
                rate=args.rate,
                duration_s=args.duration,
                warmup_s=1.0,
                seed=i,
            )
            m = run_load_blocking(spec).measured
            runs.append(run_fields(m))
        rss = round(rss_mib(cluster.pids()), 1) if cluster is not None and mode == "ray" else None
        server_rss = round(rss_mib([server.pid]), 1)
    finally:
        server.stop()
        for worker in workers:
            worker.stop()

    def med(key: str, q: str) -> float:
        return round(statistics.median(r[key][q] or 0.0 for r in runs), 3)

    return {
        "mode": mode,
        "ready_s": round(ready_s, 2),
        "overhead_p50_ms": med("overhead_ms", "p50"),
        "overhead_p99_ms": med("overhead_ms", "p99"),
        "latency_p50_ms": med("latency_ms", "p50"),
        "latency_p99_ms": med("latency_ms", "p99"),
        "compute_p50_ms": med("compute_ms", "p50"),
        "mean_batch": med("batch_size", "mean"),
        "errors": sum(sum(r["errors"].values()) + r["mismatched"] for r in runs),
        "ray_cluster_rss_mib": rss,
        "server_rss_mib": server_rss,
        "runs": runs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=50.0, help="offered requests per second (low: batch of 1)")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="local,tcp,ray")
    args = ap.parse_args()
    modes = args.modes.split(",")
    cluster = RayCluster() if "ray" in modes else None
    results: dict = {"command": " ".join(sys.argv), "rate": args.rate, "modes": {}}
    try:
        if cluster is not None:
            results["ray_start_s"] = round(cluster.start_s, 2)
        for mode in modes:
            results["modes"][mode] = measure(mode, args, cluster)
    finally:
        if cluster is not None:
            cluster.stop()
    base = results["modes"].get("local", {}).get("overhead_p50_ms")
    print(
        f"\nsim, no compute, batch of 1, {args.rate:.0f} req/s, {args.repeats} x {args.duration:.0f} s (medians)\n"
    )
    print(
        "| workers | ready s | overhead p50 ms | p99 ms | added vs local p50 ms | latency p50/p99 ms "
        "| errors | server RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in results["modes"].items():
        added = "" if base is None else f"{r['overhead_p50_ms'] - base:+.3f}"
        print(
            f"| {mode} | {r['ready_s']} | {r['overhead_p50_ms']} | {r['overhead_p99_ms']} | {added} | "
            f"{r['latency_p50_ms']}/{r['latency_p99_ms']} | {r['errors']} | {r['server_rss_mib']} |"
        )
    if cluster is not None:
        print(
            f"\nray start: {results['ray_start_s']} s; cluster RSS with 2 actors: "
            f"{results['modes'].get('ray', {}).get('ray_cluster_rss_mib')} MiB"
        )
    write_json(OUT_DIR / "ray_overhead.json", results, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
