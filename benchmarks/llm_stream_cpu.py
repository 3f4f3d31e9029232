"""CPU per streamed token of the real front end and of the real engine loop (docs/llm-throughput.md,
"Front end and engine loop"): `inferd serve` with sim-llm at a 2 ms step (the device costs ~nothing),
`inferd bench-llm`'s load generator in this process, CPU time of the front end and of the worker read
from /proc before and after the measured run. A warm-up run comes first and is not counted.

    .venv/bin/python benchmarks/llm_stream_cpu.py [--rate 100] [--duration 10] [--output-tokens 128]

To compare two versions, run this script with PYTHONPATH pointing at the other checkout's src/: the
server is started by this interpreter with the same environment.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

from harness import InferdServer, interrupt_on
from procfs import CLK_TCK

from inferd.bench.llm_loadgen import run_llm_load_blocking
from inferd.bench.llm_workload import LengthDist, LLMLoadSpec

SIM_LLM = 'builtin = "sim-llm"\nworkers = 1\n[params]\nstep_base_ms = 2.0\nper_token_ms = 0.001\nper_context_token_ms = 0.0\n'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=100.0, help="requests/s")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of the measured run")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=128)
    args = ap.parse_args()
    interrupt_on(signal.SIGTERM)
    with InferdServer(name="llm-stream-cpu", models={"sim-llm": SIM_LLM}) as server:
        server.wait_ready()

        def spec(duration: float, seed: int) -> LLMLoadSpec:
            return LLMLoadSpec(
                url=server.url, model="sim-llm", rate=args.rate, duration_s=duration, seed=seed,
                prompt_tokens=LengthDist(args.prompt_tokens, args.prompt_tokens),
                output_tokens=LengthDist(args.output_tokens, args.output_tokens), timeout_s=30.0,
            )  # fmt: skip

        run_llm_load_blocking(spec(3.0, 1))  # warm-up: connections, imports, the engine's first steps
        front = server.pid
        before = server.cpu_ticks()
        report = run_llm_load_blocking(spec(args.duration, 2))
        after = server.cpu_ticks()
    m = report.measured
    tokens = m.output_tokens
    fe = (after.get(front, 0) - before.get(front, 0)) / CLK_TCK
    workers = sum(t - before.get(pid, 0) for pid, t in after.items() if pid != front) / CLK_TCK
    print(
        json.dumps(
            {
                "pythonpath": os.environ.get("PYTHONPATH", ""),
                "rate": args.rate,
                "duration_s": args.duration,
                "ok": m.ok,
                "errors": m.errors,
                "mismatched": m.mismatched,
                "output_tokens": tokens,
                "frontend_cpu_s": round(fe, 2),
                "worker_cpu_s": round(workers, 2),
                "frontend_us_per_token": round(fe / max(tokens, 1) * 1e6, 1),
                "worker_us_per_token": round(workers / max(tokens, 1) * 1e6, 1),
                "ttft_p99_ms": m.ttft_ms.get("p99"),
                "itl_p99_ms": m.itl_ms.get("p99"),
            }
        )
    )


if __name__ == "__main__":
    main()
