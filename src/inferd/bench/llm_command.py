"""`inferd bench-llm`: offer open-loop streaming completions to a running server; report TTFT, ITL,
TPOT, e2e, tokens/s and goodput under an SLO; check every sim-llm stream against its documented tokens."""

from __future__ import annotations

from typing import Annotated

import typer

from inferd.bench.command_line import (
    ArrivalChoice,
    ArrivalOption,
    DurationOption,
    JsonOption,
    MaxRequestsOption,
    PriorityOption,
    RateOption,
    WarmupOption,
    build_spec,
    emit,
)
from inferd.bench.llm_loadgen import run_llm_load_blocking
from inferd.bench.llm_report import render, to_json
from inferd.bench.llm_workload import LengthDist, LLMLoadSpec

_SIM_LLM = "sim-llm"


def bench_llm(
    url: Annotated[str, typer.Option(help="Base URL of the server: requests go to URL/v1/completions.")] = (
        "http://127.0.0.1:8000"
    ),
    model: Annotated[str, typer.Option(help="Model name sent in each request.")] = _SIM_LLM,
    rate: RateOption = 5.0,
    duration: DurationOption = 30.0,
    warmup: WarmupOption = 0.0,
    arrival: ArrivalOption = ArrivalChoice.poisson,
    prompt_tokens: Annotated[
        str,
        typer.Option(
            help="Prompt length in words (sim-llm tokens): N, or LOW-HIGH for uniform over LOW..HIGH."
        ),
    ] = "128",
    output_tokens: Annotated[
        str, typer.Option(help="max_tokens per request: N, or LOW-HIGH for uniform over LOW..HIGH.")
    ] = "128",
    max_requests: MaxRequestsOption = 100_000,
    seed: Annotated[int, typer.Option(help="Seed for arrival times, lengths and prompt words.")] = 0,
    timeout: Annotated[
        float,
        typer.Option(help="Client deadline per request in seconds, from its intended send time."),
    ] = 120.0,
    connections: Annotated[
        int,
        typer.Option(
            help="Most streams open at once; past it a request waits (the wait counts in its latency)."
        ),
    ] = 1000,
    ttft_slo_ms: Annotated[
        float, typer.Option(help="Goodput SLO: a good request's time to first token is at most this.")
    ] = 1500.0,
    itl_slo_ms: Annotated[
        float,
        typer.Option(
            help="Goodput SLO: a good request's own p99 inter-token latency (nearest rank: its largest "
            "gap when it has fewer than 100) is at most this."
        ),
    ] = 150.0,
    check: Annotated[
        bool | None,
        typer.Option(
            "--check/--no-check",
            help="Check each stream's text and length against sim_llm_tokens [default: on for sim-llm].",
        ),
    ] = None,
    priority: PriorityOption = None,
    json_output: JsonOption = False,
) -> None:
    """Open-loop streaming completions (latency from intended send time) with goodput under an SLO.

    Exits 1 when any checked stream was wrong (text or token count not sim-llm's documented output).
    """
    spec = build_spec(
        lambda: LLMLoadSpec(
            url=url,
            model=model,
            rate=rate,
            duration_s=duration,
            warmup_s=warmup,
            arrival=arrival.value,
            prompt_tokens=LengthDist.parse(prompt_tokens),
            output_tokens=LengthDist.parse(output_tokens),
            max_requests=max_requests,
            seed=seed,
            timeout_s=timeout,
            connections=connections,
            ttft_slo_ms=ttft_slo_ms,
            itl_slo_ms=itl_slo_ms,
            check=model == _SIM_LLM if check is None else check,
            priority=priority,
        )
    )
    report = run_llm_load_blocking(spec)
    emit(report, json_output, to_json, render)
