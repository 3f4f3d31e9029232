"""What an HTTP server alone costs per request on this machine, with no batching and no inferd: a trivial
app that answers `sim`'s digest for each request at once, under the same load tool as the server
benchmarks (open loop, every answer checked), CPU of the server process from /proc.

    --server uvicorn     uvicorn 0.54's httptools protocol and an ASGI app (what the front door was)
    --server httptools   a bare asyncio.Protocol over httptools: parse, answer, one write (the floor)

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

from harness import free_port, http_ok
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


def serve(kind: str, port: int) -> None:
    import uvloop

    gc.collect()
    gc.freeze()
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
    ap.add_argument("--server", choices=["uvicorn", "httptools"], required=True)
    ap.add_argument("--rate", type=float, default=3000.0)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)  # the child's own run
    args = ap.parse_args()
    if args.serve_port:
        serve(args.server, args.serve_port)
        return 0
    port = free_port()
    child = subprocess.Popen([sys.executable, __file__, "--server", args.server, "--serve-port", str(port)])
    try:
        while not http_ok(f"http://127.0.0.1:{port}/v2/health/ready"):
            time.sleep(0.2)
        before = cpu_ticks([child.pid])
        spec = LoadSpec(url=f"http://127.0.0.1:{port}", model="sim", rate=args.rate, duration_s=args.duration,
                        warmup_s=1.0, seed=1)  # fmt: skip
        report = run_load_blocking(spec)
        cpu = cpu_seconds_since(before, [child.pid])
        m = report.measured
        print(f"{args.server} at {args.rate:.0f} req/s: {1e6 * cpu / max(1, report.sent):.0f} us of server CPU "
              f"per request; {m.ok} ok, errors {m.errors}, mismatched {m.mismatched}, p99 {m.latency_ms.get('p99')} ms")
    finally:
        child.terminate()
        child.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
