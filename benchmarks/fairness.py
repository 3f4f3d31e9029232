"""Fairness between tenants: does a tenant that floods a model hurt another tenant of the same weight?

Starts `inferd serve` itself with two tenants of equal weight (`a`, `b`, each with an API key) and only
`sim` at base_ms = 100, per_item_ms = 1, max_batch_size = 100 (a full batch every 200 ms: ~500 req/s on
its one worker), max_queue_size = 400. Two runs, each with two `inferd bench` load generators at once
(open loop, `--header 'Authorization: Bearer KEY'`):

* share: A at --share-rate (its half of the capacity, 250 req/s), B at --b-rate (50 req/s);
* flood: A at --flood-rate (2,500 req/s, 10x its share), B at --b-rate again.

Prints, per run and tenant, what was sent, the answers by status and the latency percentiles of the ok
ones, then B's p99 in the flood run over its p99 in the share run; writes everything as JSON to
--json-out. The fairness claim: in the flood run B gets no 429 and its p99 stays close to the share
run's, while A gets the 429s.

    python benchmarks/fairness.py [--duration 20] [--warmup 2]

Exits 1 when an answer was misrouted or duplicated, 2 when the server could not be started.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import OUT_DIR, InferdServer, ServerNotReady, cell, inferd_command, interrupt_on, write_json

from inferd.gateway.keys import key_digest, new_key

KEYS = {"a": new_key(), "b": new_key()}
CONFIG = f"""\
[tenants.a]
api_key_sha256 = ["{key_digest(KEYS["a"])}"]

[tenants.b]
api_key_sha256 = ["{key_digest(KEYS["b"])}"]

[models.sim]
max_batch_size = 100
max_queue_size = 400

[models.sim.params]
base_ms = 100.0
per_item_ms = 1.0
"""


def bench(url: str, tenant: str, rate: float, args: argparse.Namespace, seed: int) -> subprocess.Popen[bytes]:
    cmd = inferd_command(
        "bench",
        "--url",
        url,
        "--rate",
        str(rate),
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--timeout-ms",
        "5000",
        "--connections",
        "1000",
        "--seed",
        str(seed),
        "--header",
        f"Authorization: Bearer {KEYS[tenant]}",
        "--json",
    )
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run(url: str, a_rate: float, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """A and B at once; each generator's JSON report."""
    procs = {"a": bench(url, "a", a_rate, args, seed), "b": bench(url, "b", args.b_rate, args, seed + 1)}
    limit = args.warmup + args.duration + 60
    out: dict[str, Any] = {}
    for tenant, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=limit)
        if not stdout.strip():
            raise RuntimeError(f"bench for tenant {tenant} printed nothing: {stderr.decode()[-2000:]}")
        out[tenant] = json.loads(stdout)
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    m = report["measured"]
    return {
        "sent": m["sent"],
        "offered_rps": m["offered_rps"],
        "ok": m["ok"],
        "achieved_rps": m["achieved_rps"],
        "errors": {k: v for k, v in m["errors"].items() if v},
        "latency_ms": m["latency_ms"],
        "mismatched": report["mismatched_total"],
    }


def render(runs: dict[str, dict[str, Any]]) -> None:
    print("| run | tenant | offered req/s | sent | ok | ok req/s | 429 | other errors | p50 ms | p99 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, tenants in runs.items():
        for tenant, s in tenants.items():
            errors = dict(s["errors"])
            rejected = errors.pop("http_429", 0)
            lat = s["latency_ms"]
            print(
                f"| {name} | {tenant} | {cell(s['offered_rps'], 0)} | {s['sent']:,} | {s['ok']:,} | "
                f"{cell(s['achieved_rps'])} | {rejected:,} | {sum(errors.values()):,} {errors or ''} | "
                f"{cell(lat.get('p50'))} | {cell(lat.get('p99'))} |"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of each measured window")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before it")
    parser.add_argument("--b-rate", type=float, default=50.0, help="tenant B's req/s in both runs")
    parser.add_argument("--share-rate", type=float, default=250.0, help="tenant A's req/s: its share")
    parser.add_argument("--flood-rate", type=float, default=2500.0, help="tenant A's req/s: the flood")
    parser.add_argument("--json-out", type=Path, default=OUT_DIR / "fairness.json")
    args = parser.parse_args()
    interrupt_on(signal.SIGTERM)
    log_path = args.json_out.with_name("fairness_server.log")
    runs: dict[str, dict[str, Any]] = {}
    mismatched = 0
    for name, a_rate, seed in (("share", args.share_rate, 1), ("flood", args.flood_rate, 3)):
        server = InferdServer(
            "--model", "sim", "--no-admin", "--log-level", "WARNING",
            name=f"fairness_{name}", config=CONFIG, log_path=log_path,
        )  # fmt: skip
        try:
            with server:
                reports = run(server.url, a_rate, args, seed)
        except ServerNotReady as exc:
            print(f"error: {exc}")
            return 2
        runs[name] = {t: summary(r) for t, r in reports.items()}
        mismatched += sum(s["mismatched"] for s in runs[name].values())
    render(runs)
    share_p99 = runs["share"]["b"]["latency_ms"].get("p99")
    flood_p99 = runs["flood"]["b"]["latency_ms"].get("p99")
    ratio = flood_p99 / share_p99 if share_p99 and flood_p99 else None
    print(f"\nB's p99 in the flood run / in the share run: {cell(ratio, 2)}")
    write_json(args.json_out, {"runs": runs, "b_p99_ratio": ratio, "args": vars(args) | {"json_out": ""}})
    print(f"JSON report: {args.json_out}")
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
