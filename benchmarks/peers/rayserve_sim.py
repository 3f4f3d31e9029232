"""The `sim` device served by Ray Serve, answering KServe OIP v2 JSON on /v2/models/sim/infer.

Run it from its own virtualenv (Ray is not an inferd dependency; compare_peers.py builds one):

    .bench/venvs/rayserve/bin/python benchmarks/peers/rayserve_sim.py --port 8102

It starts a private local Ray cluster (`ray.init(num_cpus=2, include_dashboard=False)` on 127.0.0.1),
deploys one replica, prints `READY <url>` once the application is running, and on SIGTERM/SIGINT shuts
Serve and the cluster down (ray.shutdown() stops the GCS, raylet and workers that ray.init started).

Same device as inferd's `sim` model: a batch of n costs 20 ms + 0.1 ms x n of wall time (time.sleep),
one batch at a time, and each item's OUTPUT0 is sha256(b"sim:1:" + INPUT0).hexdigest()[:32], so
`inferd bench` checks every answer.

Ray Serve's idiomatic batching: `@serve.batch(max_batch_size=100, batch_wait_timeout_s=0.010)` on an
async method that each request awaits with its own item (max_concurrent_batches=1: one device). The
blocking device call runs in a thread (asyncio.to_thread) so the replica's event loop keeps accepting
requests into the next batch while the device is busy. Settings (ray 2.60.0): one replica with
max_ongoing_requests=1000 (the default, 5, would cap every batch at 5 items), num_cpus=0 for the replica
actor so it never waits for a CPU slot, HTTP proxy on 127.0.0.1 (the default per-node proxy; the
experimental HAProxy and direct-ingress modes are not used), access log off, Serve log level WARNING.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import signal
import sys
import time
from typing import Any

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

MODEL = "sim"
VERSION = "1"
BASE_S = 0.020
PER_ITEM_S = 0.0001
ROUTE = f"/v2/models/{MODEL}/infer"
_PREFIX = f"{MODEL}:{VERSION}:".encode()


def _device(items: list[bytes]) -> list[str]:
    """One device call for a batch: the digests, then sleep out the rest of base + per_item * n."""
    start = time.perf_counter()
    out = [hashlib.sha256(_PREFIX + item).hexdigest()[:32] for item in items]
    remaining = BASE_S + PER_ITEM_S * len(items) - (time.perf_counter() - start)
    if remaining > 0:
        time.sleep(remaining)
    return out


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=1000,
    max_queued_requests=-1,
    ray_actor_options={"num_cpus": 0},
)
class Sim:
    @serve.batch(max_batch_size=100, batch_wait_timeout_s=0.010, max_concurrent_batches=1)
    async def predict(self, items: list[bytes]) -> list[str]:
        return await asyncio.to_thread(_device, items)

    async def __call__(self, request: Request) -> Response:
        body = await request.json()
        data = body["inputs"][0]["data"][0]
        item = data.encode() if isinstance(data, str) else bytes(data)
        digest = await self.predict(item)
        answer: dict[str, Any] = {
            "model_name": MODEL,
            "model_version": VERSION,
            "outputs": [{"name": "OUTPUT0", "shape": [1], "datatype": "BYTES", "data": [digest]}],
        }
        if body.get("id") is not None:
            answer["id"] = body["id"]
        return Response(json.dumps(answer).encode(), media_type="application/json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8102)
    parser.add_argument("--num-cpus", type=int, default=2)
    args = parser.parse_args()

    stop = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    ray.init(
        num_cpus=args.num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=256 * 1024 * 1024,
        logging_level="WARNING",
        log_to_driver=False,
    )
    # After ray.init, which installs its own SIGTERM handler (it kills the driver and orphans agents).
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        logging_config = {"enable_access_log": False, "log_level": "WARNING"}
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config=logging_config)
        serve.run(Sim.bind(), name=MODEL, route_prefix=ROUTE, logging_config=logging_config)
        print(f"READY http://{args.host}:{args.port}{ROUTE}", flush=True)
        while not stop:
            time.sleep(0.2)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
