"""The load generator's own ceiling: `inferd bench` against a trivial server.

The server runs in a separate process (pinned to the last CPU when it can be) and answers each request
with a precomputed correct body (right id, right sim digest) looked up by the request id, so nearly all
of its work is aiohttp's HTTP handling. The generator runs here (pinned to CPU 0) at a ladder of
offered rates, once per HTTP client (`raw`, the default, and `aiohttp`); for each we print achieved
rate, latency, and the generator's CPU microseconds per request (warmup included, like the report).

    python benchmarks/bench_selftest.py [--rates 1000,3000,5000] [--clients raw,aiohttp]
                                        [--duration 5] [--warmup 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys

import msgspec
from harness import ServerProcess, free_port
from procfs import cpu_seconds

from inferd.bench.infer_requests import payload_for, request_id
from inferd.bench.loadgen import LoadSpec, run_load_blocking
from inferd.bench.report import LoadReport
from inferd.models.sim import sim_digest

_HEADERS = {
    "Content-Type": "application/json",
    "X-Inferd-Queue-Ms": "0.0",
    "X-Inferd-Compute-Ms": "0.0",
    "X-Inferd-Batch-Size": "1",
}


def _answers(seeds: list[int], count: int, payload_bytes: int) -> dict[bytes, bytes]:
    """Every correct response body the generator can ask for, keyed by request id."""
    out: dict[bytes, bytes] = {}
    for seed in seeds:
        for i in range(count):
            rid = request_id(seed, i)
            digest = sim_digest("sim", 1, payload_for(seed, i, payload_bytes))
            output = {"name": "OUTPUT0", "datatype": "BYTES", "shape": [1], "data": [digest]}
            answer = {"model_name": "sim", "model_version": "1", "id": rid, "outputs": [output]}
            out[rid.encode()] = msgspec.json.encode(answer | {"parameters": {}})
    return out


def serve(port: int, seeds: list[int], count: int, payload_bytes: int) -> None:
    """The trivial server: aiohttp's low-level server, one dict lookup per request."""
    import uvloop
    from aiohttp import web

    answers = _answers(seeds, count, payload_bytes)

    async def handle(request: web.BaseRequest) -> web.Response:
        body = await request.read()
        start = body.index(b'"id":"') + 6
        rid = body[start : body.index(b'"', start)]
        return web.Response(body=answers[rid], headers=_HEADERS)

    async def main() -> None:
        runner = web.ServerRunner(web.Server(handle, access_log=None))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
        await site.start()
        await asyncio.Event().wait()

    uvloop.run(main())


def _pin(cpu: int) -> None:
    try:
        os.sched_setaffinity(0, {cpu % (os.cpu_count() or 1)})
    except (AttributeError, OSError):
        pass


class SelftestServer(ServerProcess):
    """This script's `--serve` on 127.0.0.1:`port`, ready once it accepts connections."""

    def __init__(self, port: int, seeds: list[int], count: int, payload_bytes: int) -> None:
        cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--seeds", ",".join(map(str, seeds))]
        cmd += ["--count", str(count), "--payload-bytes", str(payload_bytes)]
        super().__init__(cmd, name="selftest server", ready_timeout_s=60.0, grace_s=5.0)
        self.port = port

    def ready(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True


def _row(client: str, rate: float, report: LoadReport, server_cpu_s: float) -> str:
    m = report.measured
    errors = sum(m.errors.values())
    lat = m.latency_ms
    util = report.generator_cpu_s / report.elapsed_s
    return (
        f"{client:>8} {rate:>8,.0f} {m.offered_rps:>9,.0f} {m.achieved_rps:>9,.0f} {errors:>7,} "
        f"{m.mismatched:>5} "
        f"{lat['p50'] or 0:>8.2f} {lat['p99'] or 0:>8.2f} {m.send_lag_ms['p99'] or 0:>8.2f} "
        f"{report.cpu_us_per_request:>8.1f} {util:>6.0%} {server_cpu_s * 1e6 / max(1, report.sent):>9.1f}"
        + "".join(f" {kind}={count}" for kind, count in m.errors.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rates", default="1000,3000,5000")
    parser.add_argument("--clients", default="raw,aiohttp", help="comma-separated: raw, aiohttp")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--payload-bytes", type=int, default=32)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", default="", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _pin(-1)
        serve(args.port, [int(s) for s in args.seeds.split(",")], args.count, args.payload_bytes)
        return
    rates = [float(r) for r in args.rates.split(",")]
    clients = args.clients.split(",")
    runs = [(client, rate) for client in clients for rate in rates]
    seeds = list(range(1, len(runs) + 1))
    count = int(max(rates) * (args.duration + args.warmup) * 1.2) + 100
    with SelftestServer(free_port(), seeds, count, args.payload_bytes) as server:
        print(f"server ready on port {server.port} after {server.ready_s:.1f} s; generator pinned to CPU 0")
        offer(server, runs, seeds, args)


def offer(
    server: SelftestServer, runs: list[tuple[str, float]], seeds: list[int], args: argparse.Namespace
) -> None:
    _pin(0)
    print(
        f"{'client':>8} {'rate':>8} {'offered':>9} {'achieved':>9} {'errors':>7} {'mism':>5} "
        f"{'p50 ms':>8} {'p99 ms':>8} "
        f"{'lag p99':>8} {'gen us/r':>8} {'genCPU':>6} {'srv us/r':>9}"
    )
    for (client, rate), seed in zip(runs, seeds, strict=True):
        spec = LoadSpec(
            url=f"http://127.0.0.1:{server.port}",
            rate=rate,
            duration_s=args.duration,
            warmup_s=args.warmup,
            timeout_ms=2000.0,
            payload_bytes=args.payload_bytes,
            seed=seed,
            client=client,  # type: ignore[arg-type]
        )
        server_cpu = cpu_seconds([server.pid])
        report = run_load_blocking(spec)
        print(_row(client, rate, report, cpu_seconds([server.pid]) - server_cpu), flush=True)


if __name__ == "__main__":
    main()
