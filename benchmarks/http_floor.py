"""What an HTTP server alone costs per request on this machine, with no batching and no inferd: a trivial
app that answers `sim`'s digest for each request at once, under the same load tool as the server
benchmarks (open loop, every answer checked), CPU of the server process from /proc.

    --server uvicorn     uvicorn 0.54's httptools protocol and an ASGI app (what the front door was)
    --server httptools   a bare asyncio.Protocol over httptools: parse, answer, one write (the floor)
    --server grpc        a bare grpc.aio server (grpcio's asyncio API, as the gRPC edge uses it) with
                         Triton's ModelInfer as a generic bytes-in, bytes-out handler: parse the request
                         with the generated message, answer in raw_output_contents (the gRPC floor),
                         under `inferd bench --protocol grpc`

    .venv/bin/python benchmarks/http_floor.py --server uvicorn --rate 3000 [--duration 8]

Prints the server's CPU us per request and the load report's throughput line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import time

from harness import free_port, http_ok, port_free
from procfs import cpu_seconds_since, cpu_ticks

from inferd.bench.loadgen import LoadSpec, run_load_blocking
from inferd.models.sim import sim_digest


def answer(body: bytes) -> bytes:
    req = json.loads(body)
    data = [sim_digest("sim", 1, x) for x in req["inputs"][0]["data"]]
    out = {"model_name": "sim", "model_version": "1", "id": req.get("id"),
           "outputs": [{"name": "OUTPUT0", "shape": [len(data)], "datatype": "BYTES", "data": data}]}  # fmt: skip
    return json.dumps(out).encode()


async def asgi_app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    out = b"" if scope["path"].endswith("/ready") else answer(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": out})


class Bare(asyncio.Protocol):
    def connection_made(self, transport):  # type: ignore[no-untyped-def]
        import httptools

        self.transport, self.parser, self.body, self.url = transport, httptools.HttpRequestParser(self), [], b""

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        out = b"" if self.url.endswith(b"/ready") else answer(body)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(out)
        self.transport.write(head + out)


def grpc_answer(raw: bytes) -> bytes:
    from inferd.bench.grpc_infer import bytes_element, first_bytes_element
    from inferd.grpc_edge.protos import grpc_service_pb2 as pb

    req = pb.ModelInferRequest.FromString(raw)
    digest = sim_digest(req.model_name, 1, first_bytes_element(req.raw_input_contents[0]).decode())
    resp = pb.ModelInferResponse(model_name=req.model_name, model_version="1", id=req.id)
    resp.outputs.add(name="OUTPUT0", datatype="BYTES", shape=[1])
    resp.raw_output_contents.append(bytes_element(digest.encode()))
    return resp.SerializeToString()


async def serve_grpc(port: int) -> None:
    import grpc

    async def infer(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return grpc_answer(raw)

    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port + 1}")
    await server.start()
    ready = await asyncio.get_running_loop().create_server(Bare, "127.0.0.1", port)  # /v2/health/ready
    async with ready:
        await server.wait_for_termination()


def serve(kind: str, port: int, loop: str = "uvloop") -> None:
    import uvloop

    gc.collect()
    gc.freeze()
    if kind == "grpc":
        (asyncio.run if loop == "asyncio" else uvloop.run)(serve_grpc(port))
        return
    if kind == "uvicorn":
        import uvicorn

        uvicorn.run(asgi_app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", ws="none",
                    access_log=False, log_level="warning")  # fmt: skip
        return

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Bare, "127.0.0.1", port, backlog=4096)
        await server.serve_forever()

    uvloop.run(main())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=["uvicorn", "httptools", "grpc"], required=True)
    ap.add_argument("--rate", type=float, default=3000.0)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="--server grpc: its loop")
    ap.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)  # the child's own run
    args = ap.parse_args()
    if args.serve_port:
        serve(args.server, args.serve_port, args.loop)
        return 0
    port = free_port()
    while not port_free(port + 1):
        port = free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, "--server", args.server, "--loop", args.loop, "--serve-port", str(port)]
    )
    try:
        while not http_ok(f"http://127.0.0.1:{port}/v2/health/ready"):
            time.sleep(0.2)
        before = cpu_ticks([child.pid])
        url = f"127.0.0.1:{port + 1}" if args.server == "grpc" else f"http://127.0.0.1:{port}"
        protocol = "grpc" if args.server == "grpc" else "http"
        spec = LoadSpec(url=url, protocol=protocol, model="sim", rate=args.rate, duration_s=args.duration,
                        warmup_s=1.0, seed=1)  # fmt: skip
        report = run_load_blocking(spec)
        cpu = cpu_seconds_since(before, [child.pid])
        m = report.measured
        print(f"{args.server} at {args.rate:.0f} req/s: {1e6 * cpu / max(1, report.sent):.0f} us of server CPU "
              f"per request; {m.ok} ok, errors {m.errors}, mismatched {m.mismatched}, p99 {m.latency_ms.get('p99')} ms; "
              f"load tool {report.cpu_us_per_request:.0f} us per request")
    finally:
        child.terminate()
        child.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
