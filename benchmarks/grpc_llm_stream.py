"""LLM streaming over gRPC against SSE on one server: sim-llm at a 2 ms step (the device costs next to
nothing, so what moves is the front end), the same open-loop tool (`inferd bench-llm`'s) and the same
check of every stream's text, through `ModelStreamInfer` with Triton's vLLM tensors (one stream per
request over a few channels, or with `--streams N` every request on one of N long-lived streams, as
tritonclient's start_stream sends them) and through streaming `/v1/completions` (SSE, a connection per
request).

For each protocol, alternating, `--repeats` times after one warm-up run of each: TTFT and ITL (p50/p99,
from the intended send time, as `inferd bench-llm` measures them) and the CPU per streamed token of the
front end (the `inferd serve` process, where both edges run; /proc/PID/stat, every thread) and of the
worker, over the measured run.

    .venv/bin/python benchmarks/grpc_llm_stream.py [--rate 50] [--duration 8] [--output-tokens 64]

`--model smollm2`: the real SmolLM2-135M on the CPU (llama.cpp) instead, texts not checked (a real
model's); its output tokens are the usage chunk's count over SSE and the text-carrying responses over
gRPC (one per token unless the detokenizer holds a piece back). Use a low rate (e.g. 2 req/s, 32
tokens): the model takes most of two cores.

With `--floor` (the default for sim-llm), one more gRPC run against a bare grpc.aio server (this script,
in a process of its own: a generic ModelStreamInfer handler that answers sim-llm's words one response
each, 2 ms apart, then the final response): the CPU per streamed message grpcio itself costs, the floor
under the edge's.

Bounded: 2 x (1 + repeats) + 1 runs of at most duration + 30 s each. Prints a markdown table and one JSON
line (also in .bench/grpc_llm_stream.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

from grpc_vs_rest import server_ports, wait_grpc
from harness import OUT_DIR, InferdServer, ServerProcess, cell, free_port, interrupt_on, write_json
from procfs import CLK_TCK, machine_busy_s

from inferd.bench.llm_loadgen import run_llm_load_blocking
from inferd.bench.llm_workload import LengthDist, LLMLoadSpec

SIM_LLM = (
    'builtin = "sim-llm"\nworkers = 1\n[params]\nstep_base_ms = 2.0\nper_token_ms = 0.001\n'
    "per_context_token_ms = 0.0\n"
)
PROTOCOLS = ("http", "grpc")
MODELS = {"sim-llm": SIM_LLM, "smollm2": 'builtin = "smollm2"\n'}


def one_run(server: InferdServer | ServerProcess, target: str, protocol: str, duration: float, seed: int,
            args: argparse.Namespace) -> dict:  # fmt: skip
    spec = LLMLoadSpec(
        url=server.url if protocol == "http" else target,  # type: ignore[union-attr]
        protocol=protocol, channels=args.channels,
        streams=args.streams,
        model=args.model, rate=args.rate, duration_s=duration, seed=seed, timeout_s=30.0,
        check=args.model == "sim-llm",
        prompt_tokens=LengthDist(args.prompt_tokens, args.prompt_tokens),
        output_tokens=LengthDist(args.output_tokens, args.output_tokens),
    )  # fmt: skip
    front = server.pid
    before = server.cpu_ticks()
    busy0 = machine_busy_s()
    report = run_llm_load_blocking(spec)
    after = server.cpu_ticks()
    fe = (after.get(front, 0) - before.get(front, 0)) / CLK_TCK
    workers = sum(t - before.get(pid, 0) for pid, t in after.items() if pid != front) / CLK_TCK
    other = machine_busy_s() - busy0 - fe - workers - report.generator_cpu_s
    m = report.measured
    tokens = max(1, m.output_tokens)
    return {
        "protocol": protocol,
        "rate": args.rate,
        "sent": m.sent,
        "ok": m.ok,
        "errors": m.errors,
        "mismatched": report.mismatched_total,
        "output_tokens": m.output_tokens,
        "ttft_p50_ms": m.ttft_ms.get("p50"),
        "ttft_p99_ms": m.ttft_ms.get("p99"),
        "itl_p50_ms": m.itl_ms.get("p50"),
        "itl_p99_ms": m.itl_ms.get("p99"),
        "frontend_us_per_token": round(fe / tokens * 1e6, 1),
        "worker_us_per_token": round(workers / tokens * 1e6, 1),
        "generator_us_per_token": round(report.generator_cpu_s / tokens * 1e6, 1),
        "other_cpu_s": round(max(0.0, other), 2),
        "load_1m": round(os.getloadavg()[0], 2),
    }


async def serve_floor(port: int) -> None:
    """The floor: ModelStreamInfer as a bare grpc.aio handler, sim-llm's words at a 2 ms step."""
    import asyncio

    import grpc

    from inferd.bench.grpc_infer import bytes_element
    from inferd.bench.grpc_llm import bytes_elements
    from inferd.grpc_edge.protos import grpc_service_pb2 as pb
    from inferd.kinds.llm.sim_llm import sim_llm_tokens

    def response(rid: str, text: str | None) -> bytes:
        resp = pb.ModelInferResponse(model_name="sim-llm", model_version="1", id=rid)
        if text is not None:
            resp.outputs.add(name="text_output", datatype="BYTES", shape=[1])
            resp.raw_output_contents.append(bytes_element(text.encode()))
        resp.parameters["triton_final_response"].bool_param = text is None
        return pb.ModelStreamInferResponse(infer_response=resp).SerializeToString()

    async def stream(requests, context):  # type: ignore[no-untyped-def]
        async for raw in requests:
            req = pb.ModelInferRequest.FromString(raw)
            tensors = {t.name: c for t, c in zip(req.inputs, req.raw_input_contents, strict=True)}
            params = json.loads(bytes_elements(tensors["sampling_parameters"])[0])
            prompt = bytes_elements(tensors["text_input"])[0].decode()
            for k, word in enumerate(sim_llm_tokens(prompt, params["seed"], params["max_tokens"])):
                await asyncio.sleep(0.002)
                yield response(req.id, word if k == 0 else " " + word)
            yield response(req.id, None)

    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def floor_run(args: argparse.Namespace) -> dict:
    """One gRPC run against the bare grpc.aio floor, in a process of its own."""
    port = free_port()
    floor = ServerProcess([sys.executable, __file__, "--serve-floor", str(port)], name="grpc_floor",
                          log_path=OUT_DIR / "grpc_llm_stream.floor.log")  # fmt: skip
    with floor:
        wait_grpc(f"127.0.0.1:{port}", 30.0)
        return {
            **one_run(floor, f"127.0.0.1:{port}", "grpc", args.duration, 50, args),
            "protocol": "grpc floor",
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="sim-llm")
    ap.add_argument("--rate", type=float, default=50.0, help="requests/s")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of each measured run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--channels", type=int, default=4, help="gRPC channels of the load tool")
    ap.add_argument(
        "--streams",
        type=int,
        default=0,
        help="gRPC: 0, a stream per request; N, every request on one of N long-lived streams",
    )
    ap.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure a bare grpc.aio stream handler (sim-llm only)",
    )
    ap.add_argument("--tree", default=None, help="serve this checkout's src/ instead of this tree's")
    ap.add_argument("--serve-floor", type=int, help=argparse.SUPPRESS)  # the floor's own process
    args = ap.parse_args()
    if args.serve_floor:
        import uvloop

        uvloop.run(serve_floor(args.serve_floor))
        return 0
    interrupt_on(signal.SIGTERM)
    env = None if args.tree is None else {"PYTHONPATH": os.path.join(os.path.abspath(args.tree), "src")}
    http_port, grpc_port = server_ports()
    target = f"127.0.0.1:{grpc_port}"
    out: dict = {"command": " ".join(sys.argv), "runs": []}
    server = InferdServer(
        "--grpc-port", str(grpc_port), name="grpc_llm_stream", port=http_port, models={args.model: MODELS[args.model]},
        log_path=OUT_DIR / "grpc_llm_stream.server.log", ready_timeout_s=60.0, grace_s=30.0, env=env,
    )  # fmt: skip
    t_start = time.monotonic()
    with server:
        wait_grpc(target, 30.0)
        for protocol in PROTOCOLS:  # warm-up: connections, imports, the engine's first steps
            one_run(server, target, protocol, 2.0, 100, args)
        for repeat in range(args.repeats):
            for protocol in PROTOCOLS if repeat % 2 == 0 else PROTOCOLS[::-1]:
                run = one_run(server, target, protocol, args.duration, repeat + 1, args)
                out["runs"].append(run)
                print(f"  {protocol}: front end {run['frontend_us_per_token']} us/token, "
                      f"ITL p99 {cell(run['itl_p99_ms'])} ms", file=sys.stderr)  # fmt: skip
    if args.floor and args.model == "sim-llm":
        out["runs"].append(floor_run(args))
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    model = "sim-llm (2 ms step)" if args.model == "sim-llm" else args.model
    shared = f"requests on {args.streams} long-lived streams" if args.streams else "a stream per request"
    print(f"\n{model}, {args.rate:g} req/s, prompt {args.prompt_tokens} / output "
          f"{args.output_tokens} tokens; gRPC: ModelStreamInfer, {shared}; http: SSE\n")  # fmt: skip
    print("| protocol | ok/sent | errors | TTFT p50 / p99 ms | ITL p50 / p99 ms | front end us/token "
          "| worker us/token | load tool us/token | other CPU s | load 1m |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["runs"]:
        print(
            f"| {r['protocol']} | {r['ok']}/{r['sent']} | {r['errors'] or '-'} "
            f"| {cell(r['ttft_p50_ms'], 2)} / {cell(r['ttft_p99_ms'], 2)} "
            f"| {cell(r['itl_p50_ms'], 2)} / {cell(r['itl_p99_ms'], 2)} | {r['frontend_us_per_token']:.1f} "
            f"| {r['worker_us_per_token']:.1f} | {r['generator_us_per_token']:.1f} | {r['other_cpu_s']} "
            f"| {r['load_1m']} |"
        )
    summary: dict = {}
    for protocol in sorted({r["protocol"] for r in out["runs"]}):
        runs = [r for r in out["runs"] if r["protocol"] == protocol]
        summary[protocol] = {
            key: round(statistics.median(r[key] or 0 for r in runs), 3)
            for key in ("frontend_us_per_token", "itl_p50_ms", "itl_p99_ms", "ttft_p99_ms")
        }
        summary[protocol]["mismatched"] = sum(r["mismatched"] for r in runs)
        summary[protocol]["errors"] = sum(sum(r["errors"].values()) for r in runs)
    summary["frontend_ratio_grpc_over_http"] = round(
        summary["grpc"]["frontend_us_per_token"] / max(1e-9, summary["http"]["frontend_us_per_token"]), 3
    )
    out["summary"] = summary
    write_json(OUT_DIR / "grpc_llm_stream.json", out)
    print(json.dumps({"summary": summary, "wall_s": out["wall_s"], "command": out["command"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
