"""sim-llm: goodput under an SLO with continuous batching vs static (request-level) batching, at the same
offered load.

For each policy this starts its own `inferd serve` (own process group) on a temporary model repository
holding only `sim-llm` with `[params.scheduler] policy = "continuous"` or `"static"` (every other
scheduler and cost-model setting at its default, the same for both), offers the same open-loop Poisson
load with `inferd.bench.llm_loadgen` (identical seeds, so identical arrival times, prompts and lengths),
checks every stream against `sim_llm_tokens`, and always stops the server.

Goodput: requests whose TTFT <= --ttft-slo-ms and whose own p99 ITL <= --itl-slo-ms, per second of
span (window start to last completion); see `inferd.bench.llm_report`. The ratio is also given on good
counts (the same requests were offered to both).

    .venv/bin/python benchmarks/llm_sim.py [--rate 9] [--duration 40] [--prompt-tokens 32-512]
        [--output-tokens 16-256] [--policies continuous,static]

Writes .bench/llm_sim.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from harness import OUT_DIR, InferdServer, write_json

from inferd.bench.llm_loadgen import run_llm_load_blocking
from inferd.bench.llm_report import LLMPhaseReport
from inferd.bench.llm_workload import LengthDist, LLMLoadSpec

MODEL_TOML = 'builtin = "sim-llm"\n\n[params.scheduler]\npolicy = "{policy}"\n'


def server(policy: str) -> InferdServer:
    """`inferd serve` serving only sim-llm with one scheduler policy."""
    return InferdServer(
        "--no-admin",
        "--log-level",
        "WARNING",
        name=f"llm_sim_{policy}",
        models={"sim-llm": MODEL_TOML.format(policy=policy)},
        log_path=OUT_DIR / f"llm_sim_{policy}_server.log",
    )


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    with server(policy) as srv:
        spec = LLMLoadSpec(
            url=srv.url,
            model="sim-llm",
            rate=args.rate,
            duration_s=args.duration,
            warmup_s=args.warmup,
            prompt_tokens=LengthDist.parse(args.prompt_tokens),
            output_tokens=LengthDist.parse(args.output_tokens),
            seed=args.seed,
            timeout_s=args.timeout,
            ttft_slo_ms=args.ttft_slo_ms,
            itl_slo_ms=args.itl_slo_ms,
            check=True,
        )
        t0 = time.monotonic()
        report = run_llm_load_blocking(spec)
        print(f"{policy}: run took {time.monotonic() - t0:.1f} s", flush=True)
    return report.to_dict()


def summary_row(policy: str, m: dict[str, Any]) -> str:
    p = LLMPhaseReport(**m)
    attainment = 0.0 if p.slo_attainment is None else 100 * p.slo_attainment
    errors = sum(p.errors.values())
    return (
        f"| {policy} | {p.offered_rps:.2f} | {p.goodput_rps:.2f} | {p.good}/{p.sent} ({attainment:.1f}%) "
        f"| {p.request_rps:.2f} | {p.output_tokens_per_s:,.0f} "
        f"| {p.ttft_ms['p50']:,.0f} / {p.ttft_ms['p99']:,.0f} | {p.itl_ms['p50']:,.1f} / {p.itl_ms['p99']:,.1f} "
        f"| {p.tpot_ms['p50']:,.1f} / {p.tpot_ms['p99']:,.1f} | {p.e2e_ms['p50']:,.0f} / {p.e2e_ms['p99']:,.0f} "
        f"| {errors} | {p.mismatched} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=9.0, help="offered requests/s (Poisson)")
    ap.add_argument("--duration", type=float, default=40.0, help="measured window, s")
    ap.add_argument("--warmup", type=float, default=0.0)
    ap.add_argument("--prompt-tokens", default="32-512")
    ap.add_argument("--output-tokens", default="16-256")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0, help="per-request deadline from intended send, s")
    ap.add_argument("--ttft-slo-ms", type=float, default=1500.0)
    ap.add_argument("--itl-slo-ms", type=float, default=150.0)
    ap.add_argument("--policies", default="continuous,static")
    args = ap.parse_args()
    results = {policy: run_policy(policy, args) for policy in args.policies.split(",")}
    out = write_json(OUT_DIR / "llm_sim.json", {"args": vars(args), "results": results}, indent=2)
    print(f"\nwrote {out}\n")
    print(
        "| policy | offered req/s | goodput req/s | good/sent | ok req/s | output tok/s | TTFT ms p50 / p99 "
        "| ITL ms p50 / p99 | TPOT ms p50 / p99 | e2e ms p50 / p99 | errors | mismatched |"
    )
    print("|" + "---|" * 12)
    for policy, report in results.items():
        print(summary_row(policy, report["measured"]))
    if {"continuous", "static"} <= results.keys():
        c, s = results["continuous"]["measured"], results["static"]["measured"]
        rate_ratio = c["goodput_rps"] / s["goodput_rps"] if s["goodput_rps"] else float("inf")
        count_ratio = c["good"] / s["good"] if s["good"] else float("inf")
        print(f"\ncontinuous / static goodput: {rate_ratio:.2f}x (req/s), {count_ratio:.2f}x (good requests)")
    mismatched = sum(r["mismatched_total"] for r in results.values())
    return 1 if mismatched else 0


if __name__ == "__main__":
    raise SystemExit(main())
