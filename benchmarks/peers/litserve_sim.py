"""The `sim` device served by LitServe, answering KServe OIP v2 JSON on /v2/models/sim/infer.

Run it from its own virtualenv (LitServe is not an inferd dependency; compare_peers.py builds one):

    .bench/venvs/litserve/bin/python benchmarks/peers/litserve_sim.py --port 8101

Same device as inferd's `sim` model: a batch of n costs 20 ms + 0.1 ms x n of wall time (time.sleep),
one batch at a time (one worker), and each item's OUTPUT0 is
sha256(b"sim:1:" + INPUT0).hexdigest()[:32], so `inferd bench` checks every answer.

LitServe's idiomatic batching: decode_request (per request, in the worker) -> batch -> predict (one
device call per batch) -> unbatch -> encode_response (per request). Settings (litserve 0.2.19):
max_batch_size=100 and batch_timeout=0.010 on the LitAPI, one worker on one CPU "device", one uvicorn
API server process (num_api_servers=1: the machine has 2 cores), fast_queue=True (ZeroMQ between the
API server and the worker instead of multiprocessing queues; LitServe's fastest transport), request
tracking off, no client file, no access log, log level warning. uvicorn picks uvloop and httptools
(both installed with litserve).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import Any

import litserve as ls

MODEL = "sim"
VERSION = "1"
BASE_S = 0.020
PER_ITEM_S = 0.0001
_PREFIX = f"{MODEL}:{VERSION}:".encode()


class SimAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.prefix = _PREFIX

    def decode_request(self, request):
        # Unannotated on purpose: LitServe then parses the body as JSON and passes the dict here.
        # (An annotation would make FastAPI read `request` as a query parameter or a pydantic model.)
        data = request["inputs"][0]["data"][0]
        item = data.encode() if isinstance(data, str) else bytes(data)
        return request.get("id"), item

    def batch(self, inputs: list[tuple[str | None, bytes]]) -> list[tuple[str | None, bytes]]:
        return list(inputs)

    def predict(self, x: list[tuple[str | None, bytes]]) -> list[tuple[str | None, str]]:
        start = time.perf_counter()
        out = [(rid, hashlib.sha256(self.prefix + item).hexdigest()[:32]) for rid, item in x]
        remaining = BASE_S + PER_ITEM_S * len(x) - (time.perf_counter() - start)
        if remaining > 0:
            time.sleep(remaining)
        return out

    def unbatch(self, output: list[tuple[str | None, str]]) -> list[tuple[str | None, str]]:
        return list(output)

    def encode_response(self, output: tuple[str | None, str]) -> dict[str, Any]:
        rid, digest = output
        response: dict[str, Any] = {
            "model_name": MODEL,
            "model_version": VERSION,
            "outputs": [{"name": "OUTPUT0", "shape": [1], "datatype": "BYTES", "data": [digest]}],
        }
        if rid is not None:
            response["id"] = rid
        return response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8101)
    parser.add_argument("--no-fast-queue", action="store_true", help="use multiprocessing queues")
    args = parser.parse_args()
    api = SimAPI(max_batch_size=100, batch_timeout=0.010, api_path=f"/v2/models/{MODEL}/infer")
    server = ls.LitServer(
        api,
        accelerator="cpu",
        devices=1,
        workers_per_device=1,
        fast_queue=not args.no_fast_queue,
        track_requests=False,
        disable_openapi_url=True,
    )
    server.run(
        host=args.host,
        port=args.port,
        num_api_servers=1,
        log_level="warning",
        generate_client_file=False,
        access_log=False,
    )


if __name__ == "__main__":
    main()
