"""A canary that starts failing, rolled back by itself.

`inferd serve` with sim at versions 1 (default) and 2, a canary of weight 0.1 on v2 with the default
rollback bounds (error ratio 0.05, 60 s and 300 s windows, 20 requests). An open-loop load of unversioned
OIP requests at a steady rate; at `--fail-at` seconds the inputs switch to ones that v2's sim fails on
(its `fail_prefix`) and v1 answers as before: from then on v2 is broken. Reports when the first failure
came back, when the canary was rolled back (the admin API's history), and how many requests failed.

    .venv/bin/python benchmarks/canary.py [--rate 100] [--duration 120] [--fail-at 30]

Writes .bench/canary.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request
from typing import Any

import aiohttp
from harness import OUT_DIR, InferdServer, write_json

MODEL = """builtin = "sim"
workers = 1
version_policy = "all"
default_version = 1
max_wait_ms = 2

[params]
base_ms = 2.0
per_item_ms = 0.0

[versions.1]

[versions.2.params]
fail_prefix = "broken"

[traffic]
canary = { version = 2, weight = 0.1 }
rollback = { max_error_ratio = 0.05 }
"""


def body(text: str) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    ).encode()


async def load(url: str, rate: float, duration_s: float, fail_at_s: float) -> dict[str, Any]:
    """Open loop: one request every 1/rate s whatever the answers; the count is fixed up front."""
    start = time.time()
    results: list[tuple[float, int, str]] = []  # (sent at, status, version)

    async def one(http: aiohttp.ClientSession, i: int, sent: float) -> None:
        text = f"broken-{i}" if sent - start >= fail_at_s else f"ok-{i}"
        try:
            async with http.post(f"{url}/v2/models/sim/infer", data=body(text)) as r:
                await r.read()
                results.append((sent, r.status, r.headers.get("X-Inferd-Model-Version", "-")))
        except aiohttp.ClientError:
            results.append((sent, 0, "-"))

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256), timeout=timeout) as http:
        async with asyncio.TaskGroup() as tg:
            for i in range(int(rate * duration_s)):
                due = start + i / rate
                await asyncio.sleep(max(0.0, due - time.time()))
                tg.create_task(one(http, i, time.time()))
    failed = [(at, v) for at, status, v in results if status != 200]
    return {
        "start": start,
        "requests": len(results),
        "failed": len(failed),
        "first_failure": min((at for at, _ in failed), default=None),
        "v2_after_fail": sum(
            1 for at, status, v in results if at - start >= fail_at_s and v == "2" and status == 200
        ),
    }


def admin_traffic(admin_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{admin_url}/admin/traffic", timeout=5) as r:
        return json.loads(r.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=100.0, help="requests per second")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--fail-at", type=float, default=30.0, help="seconds before v2 starts failing")
    args = p.parse_args()
    with InferdServer(models={"sim": MODEL}, name="canary", grace_s=10.0) as server:
        admin_url = server.admin_url
        run = asyncio.run(load(server.url, args.rate, args.duration, args.fail_at))
        traffic = admin_traffic(admin_url)
    rollbacks = [e for e in traffic["history"] if e["event"] == "rolled_back"]
    first = run["first_failure"]
    rolled = rollbacks[0]["at"] if rollbacks else None
    report = {
        **vars(args),
        **run,
        "failed_ratio": run["failed"] / max(1, run["requests"]),
        "first_failure_s": None if first is None else first - run["start"],
        "rolled_back_s": None if rolled is None else rolled - run["start"],
        "rollback_after_first_failure_s": None if rolled is None or first is None else rolled - first,
        "reason": rollbacks[0]["reason"] if rollbacks else None,
    }
    write_json(OUT_DIR / "canary.json", report)
    print("| rate | duration | v2 fails from | first failure | rolled back | after first failure | failed |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.2f} s"  # noqa: E731
    print(
        f"| {args.rate:g}/s | {args.duration:g} s | {args.fail_at:g} s | {fmt(report['first_failure_s'])} | "
        f"{fmt(report['rolled_back_s'])} | {fmt(report['rollback_after_first_failure_s'])} | "
        f"{run['failed']} of {run['requests']} ({100 * report['failed_ratio']:.2f} %) |"
    )
    print(f"\nreason: {report['reason']}")


if __name__ == "__main__":
    main()
