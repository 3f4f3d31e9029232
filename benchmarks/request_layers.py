"""Where the front end's CPU per request goes, layer by layer, in one process with no sockets: requests
are fed as bytes to the front door's HTTP/1.1 protocol (api/frontdoor.py) over a transport that keeps
what is written, and `sim`'s batches are answered at once by an in-process worker (the real frame
encoding both ways, the real model code minus its sleep). Each row adds one layer to the one above:

    http          the front door alone: parse, exchange, one write (a route that answers b"{}")
    route+chain   + the router and the whole middleware chain (a handler that answers b"{}")
    infer         + the OIP infer handler, admission, the queue, batching, delivery (the real route)

Each is timed with the process's CPU clock over --requests requests, fed --batch at a time (one batch
of `sim` per round), and the best of --repeats is printed. The figures are CPU of this process only: a
real server adds the kernel's socket work, the event loop's polling, and the worker process.

    .venv/bin/python benchmarks/request_layers.py [--requests 20000] [--batch 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from inferd.api.app import Api, create_app, oip_error
from inferd.api.asgi import HttpResponse
from inferd.api.door_policy import DoorLimits, DoorPolicy
from inferd.api.frontdoor import front_door_protocol
from inferd.clock import MonotonicClock
from inferd.config import ServerConfig
from inferd.models.loader import instantiate
from inferd.models.sim import sim_config
from inferd.server import InferenceServer
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState
from inferd.worker.outputs import convert_outputs


class Transport(asyncio.Transport):
    """Keeps count of the responses written; never closes."""

    def __init__(self) -> None:
        super().__init__()
        self.responses = 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: Any) -> None:
        self.responses += bytes(data[:9]) == b"HTTP/1.1 "

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False


class InstantWorker:
    """The writer of a WorkerConnection: each RunBatch is decoded, run by sim's own code (no sleep),
    and answered with a BatchDone frame decoded again, on the loop's next turn."""

    def __init__(self, server: InferenceServer) -> None:
        self.rt = server.registry.get("sim", None)
        self.config = self.rt.config
        self.model = instantiate(self.config)
        self.model.load()
        self.model.cost_s = lambda n: 0.0  # the device's time is not the front end's
        self.transport = self
        self.conn = WorkerConnection("bench-0", "sim", 0, "local", self)  # type: ignore[arg-type]
        self.conn.state = WorkerState.READY
        self.cpu_s = 0.0
        """The worker's own share of the time (its process's, in a real server): left out of the rows."""

    def write(self, frame: bytes) -> None:
        start = time.process_time()
        self._answer(frame)
        self.cpu_s += time.process_time() - start

    def _answer(self, frame: bytes) -> None:
        msg = p.decode_message(frame[4:])
        if isinstance(msg, p.RunBatch):
            outputs, _ = convert_outputs(self.config, self.model.predict_batch(msg.items), len(msg.items))
            done = p.decode_message(p.encode_frame(p.BatchDone(msg.batch_id, 0.0, outputs))[4:])
            asyncio.get_running_loop().call_soon(self.rt.on_message, self.conn, done)

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def infer_bytes(i: int) -> bytes:
    body = json.dumps(
        {"id": f"r{i}", "inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [f"x{i}"]}]}
    ).encode()
    head = f"POST /v2/models/sim/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def measure(path: bytes, app: Any, args: argparse.Namespace, worker: InstantWorker) -> float:
    """CPU us per request through `app`'s front door, `args.batch` connections at a time."""
    door = DoorPolicy(DoorLimits(), MonotonicClock())
    config = uvicorn.Config(app, http=front_door_protocol(door, app), ws="none", log_config=None)
    config.load()
    state = ServerState()
    conns = []
    for _ in range(args.batch):
        protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
        transport = Transport()
        protocol.connection_made(transport)
        conns.append((protocol, transport))
    requests = [infer_bytes(i).replace(b"/v2/models/sim/infer", path) for i in range(args.batch)]
    best = float("inf")
    rounds = max(1, args.requests // args.batch)
    for _ in range(args.repeats):
        worker.cpu_s = 0.0
        start = time.process_time()
        for _ in range(rounds):
            for (protocol, _), data in zip(conns, requests, strict=True):
                protocol.data_received(data)
            while state.tasks:
                await asyncio.gather(*state.tasks)
        best = min(best, time.process_time() - start - worker.cpu_s)
    answered = sum(t.responses for _, t in conns)
    if answered != args.repeats * rounds * args.batch:
        raise RuntimeError(f"{answered} responses for {args.repeats * rounds * args.batch} requests")
    return 1e6 * best / (rounds * args.batch)


async def main(args: argparse.Namespace) -> None:
    server = InferenceServer(ServerConfig(admin_port=None, workers=0), [sim_config()], spawn_workers=False)
    app = create_app(server)
    api = Api(server)

    async def empty(call: Any, request: Any) -> HttpResponse:
        return HttpResponse(b"{}")

    async def bare(request: Any) -> HttpResponse:
        return HttpResponse(b"{}")

    app.router.add("POST", "/bench/http", bare)
    app.router.add("POST", "/bench/chain", api.endpoint(empty, oip_error, "/bench/chain"))
    async with server.running():
        worker = InstantWorker(server)
        worker.rt.add_worker(worker.conn)
        gc.collect()
        gc.freeze()
        gc.set_threshold(*args.gc)
        paths = {"http": b"/bench/http", "route+chain": b"/bench/chain", "infer": b"/v2/models/sim/infer"}
        rows = {
            name: await measure(path, app, args, worker)
            for name, path in paths.items()
            if args.only is None or name == args.only
        }
    print(f"CPU us per request, best of {args.repeats} x {args.requests} requests, {args.batch} at a time\n")
    print("| layers | us/req | added |")
    print("|---|---:|---:|")
    before = 0.0
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} | {us - before:+.1f} |")
        before = us


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", help="write a cProfile of the run to this file")
    ap.add_argument("--gc", type=int, nargs=3, default=(20_000, 20, 50), help="gc thresholds (the server sets 20000 20 50)")
    ap.add_argument("--only", choices=["http", "route+chain", "infer"], help="measure this row alone")
    args = ap.parse_args()
    import uvloop

    if args.profile:
        import cProfile

        cProfile.run("uvloop.run(main(args))", args.profile)
    else:
        uvloop.run(main(args))
    sys.exit(0)
