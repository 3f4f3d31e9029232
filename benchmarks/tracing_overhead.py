"""What tracing and the request context cost a request on `sim`.

1. Over HTTP, open-loop Poisson at --rate (2,000 req/s) on `sim` (the load `inferd bench` offers: the
   same LoadSpec and load generator), two servers up side by side:
   (a) tracing off (no exporter named: the default);
   (b) tracing on, 1% of traces sampled (--trace-sample 0.01), exporting OTLP/HTTP to a sink in this
       process that answers 200 to every POST /v1/traces.
   Runs are interleaved a, b, a, b, ... (--repeats each) so both see the same machine load. Reported:
   the front-end process's CPU per request sent (what (b) adds is the cost of tracing at 1%), and the
   median p50/p99 latency.
2. In process: the per-request CPU of what every request pays with tracing off (the first layer's
   request id and log context, the hot paths' `tracing.ENABLED` checks), against the same request
   without that layer: the floor of what tracing off adds to a request.

    .venv/bin/python benchmarks/tracing_overhead.py [--rate 2000] [--duration 8] [--repeats 2]

Writes .bench/tracing_overhead.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from harness import OUT_DIR, InferdServer, interrupt_on, run_fields, write_json
from procfs import cpu_seconds_since, cpu_ticks

from inferd.api.asgi import HttpRequest, HttpResponse
from inferd.api.http_call import http_call
from inferd.api.request_context import RequestContext
from inferd.bench.loadgen import LoadSpec, run_load_blocking
from inferd.core.call import Call
from inferd.observability import tracing


class Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that reads and drops what it is sent."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def run(server: InferdServer, args: argparse.Namespace, seed: int) -> dict:
    spec = LoadSpec(
        url=server.url,
        model="sim",
        rate=args.rate,
        duration_s=args.duration,
        warmup_s=args.warmup,
        timeout_ms=5000.0,
        seed=seed,
    )
    before = cpu_ticks({server.pid})
    report = run_load_blocking(spec)
    front_end_s = cpu_seconds_since(before, {server.pid})
    m = report.measured
    return {
        "achieved": round(m.achieved_rps, 1),
        "front_end_cpu_us_per_request": round(1e6 * front_end_s / max(1, report.sent), 1),
        "load_average_1m": os.getloadavg()[0],
        **run_fields(m),
    }


def over_http(args: argparse.Namespace) -> dict[str, list[dict]]:
    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}"
    serve = ("--model", "sim", "--no-admin", "--log-level", "WARNING")
    traced = ("--trace-endpoint", endpoint, "--trace-sample", str(args.sample))
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        with (
            InferdServer(*serve, name="tracing-off", ready_timeout_s=60.0) as off,
            InferdServer(*serve, *traced, name="tracing-on", ready_timeout_s=60.0) as on,
        ):
            for i in range(args.repeats):
                runs["off"].append(run(off, args, seed=100 + i))
                runs["on"].append(run(on, args, seed=200 + i))
                print(
                    f"repeat {i + 1}: off {summary(runs['off'][-1])}; on {summary(runs['on'][-1])}",
                    flush=True,
                )
    finally:
        sink.shutdown()
    return runs


def summary(r: dict) -> str:
    return (
        f"{r['achieved']:.0f} ok/s, errors {sum(r['errors'].values())}, latency p50/p99 "
        f"{r['latency_ms']['p50']:.2f}/{r['latency_ms']['p99']:.2f} ms, front end CPU "
        f"{r['front_end_cpu_us_per_request']:.0f} us/req, load average {r['load_average_1m']:.1f}"
    )


def in_process(n: int) -> dict[str, float]:
    """us per call: the chain's first layer around a trivial handler vs the handler alone (tracing off)."""
    assert not tracing.ENABLED
    response = HttpResponse(b"{}")
    scope = {"method": "POST", "path": "/v2/models/sim/infer", "headers": [(b"content-type", b"json")]}

    async def handler(call: Call, request: object) -> HttpResponse:
        response.headers.clear()
        return response

    layer = RequestContext(handler)

    async def per_call(step: Any) -> float:
        out = []
        for _ in range(5):
            calls = [
                http_call(HttpRequest(scope, None, {}), lambda e, s: b"", "/v2/models/{model}/infer", False)  # type: ignore[arg-type]
                for _ in range(n)
            ]
            start = time.perf_counter()
            for call in calls:
                await step(call, None)
            out.append((time.perf_counter() - start) / n * 1e6)
        return statistics.median(out)

    bare = asyncio.run(per_call(handler))
    with_layer = asyncio.run(per_call(layer))
    hooks = asyncio.run(per_call(lambda call, request: _hooks()))
    return {
        "handler_us": round(bare, 3),
        "with_request_context_us": round(with_layer, 3),
        "request_context_adds_us": round(with_layer - bare, 3),
        "enabled_checks_us": round(hooks, 3),
    }


async def _hooks() -> None:
    """The tracing checks a batched request passes with tracing off (enqueue, cut, done)."""
    for _ in range(3):
        if tracing.ENABLED:
            raise AssertionError("tracing is off here")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sample", type=float, default=0.01, help="Trace sample ratio of server (b).")
    ap.add_argument("--calls", type=int, default=20_000, help="In-process calls per batch.")
    args = ap.parse_args()
    interrupt_on(signal.SIGTERM)
    steps = in_process(args.calls)
    print(f"in process (tracing off): {steps}", flush=True)
    runs = over_http(args)
    result: dict[str, Any] = {"command": " ".join(sys.argv), "in_process": steps, "runs": runs}
    print("\n| | front end CPU us/req | latency p50 ms | latency p99 ms | achieved req/s | errors |")
    print("|---|---|---|---|---|---|")
    for name, label in (("off", "(a) tracing off"), ("on", f"(b) tracing on, {args.sample:.0%} sampled")):
        r = runs[name]
        cpu = statistics.median(x["front_end_cpu_us_per_request"] for x in r)
        p50 = statistics.median(x["latency_ms"]["p50"] for x in r)
        p99 = statistics.median(x["latency_ms"]["p99"] for x in r)
        achieved = statistics.median(x["achieved"] for x in r)
        errors = sum(sum(x["errors"].values()) for x in r)
        print(f"| {label} | {cpu:.0f} | {p50:.2f} | {p99:.2f} | {achieved:.0f} | {errors} |")
    path = write_json(OUT_DIR / "tracing_overhead.json", result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
