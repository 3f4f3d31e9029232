"""`inferd bench-llm`: offer open-loop streaming completions to a running server; report TTFT, ITL,
TPOT, e2e, tokens/s and goodput under an SLO; check every sim-llm stream against its documented tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from inferd.bench.command_line import (
    ArrivalChoice,
    ArrivalOption,
    DurationOption,
    JsonOption,
    MaxRequestsOption,
    PriorityOption,
    ProtocolChoice,
    RateOption,
    WarmupOption,
    build_spec,
    emit,
)
from inferd.bench.llm_loadgen import run_llm_load_blocking
from inferd.bench.llm_report import render, to_json
from inferd.bench.llm_workload import LengthDist, LLMLoadSpec
from inferd.bench.spec_checks import default_grpc_target
from inferd.fleetsim.profiles import server_cpu_s

_SIM_LLM = "sim-llm"


def bench_llm(
    url: Annotated[str, typer.Option(help="Base URL of the server: requests go to URL/v1/completions.")] = (
        "http://127.0.0.1:8000"
    ),
    model: Annotated[str, typer.Option(help="Model name sent in each request.")] = _SIM_LLM,
    protocol: Annotated[
        ProtocolChoice,
        typer.Option(
            help="http: streaming /v1/completions (SSE) at URL; grpc: ModelStreamInfer with Triton's vLLM "
            "tensors (text_input, stream, sampling_parameters) at --grpc-target."
        ),
    ] = ProtocolChoice.http,
    grpc_target: Annotated[
        str | None,
        typer.Option(help="--protocol grpc: the server's gRPC HOST:PORT (default: URL's host, its port + 1).")
    ] = None,
    channels: Annotated[
        int,
        typer.Option(help="--protocol grpc: gRPC channels (an HTTP/2 connection each) streams take in turn."),
    ] = 4,
    streams: Annotated[
        int,
        typer.Option(
            help="--protocol grpc: 0, a ModelStreamInfer stream per request; N, every request on one of N "
            "long-lived streams, answers matched by id (as tritonclient's start_stream)."
        ),
    ] = 0,
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
            help="Check each stream's text and length against sim_llm_tokens (default: on for sim-llm).",
        ),
    ] = None,
    priority: PriorityOption = None,
    json_output: JsonOption = False,
    save_profile: Annotated[
        Path | None,
        typer.Option(
            help="Fit an LLM device profile (step cost, serving overhead, front-end CPU) on the measured "
            "phase and save it as JSON for `inferd fleet-sim llm` and `inferd plan llm`."
        ),
    ] = None,
    devices: Annotated[
        int,
        typer.Option(
            min=1, help="With --save-profile: the LLM workers behind the URL (the fit is per device)."
        ),
    ] = 1,
) -> None:
    """Open-loop streaming completions (latency from intended send time) with goodput under an SLO.

    Exits 1 when any checked stream was wrong (text or token count not sim-llm's documented output).
    """
    spec = build_spec(
        lambda: LLMLoadSpec(
            url=url if protocol is ProtocolChoice.http else grpc_target or default_grpc_target(url),
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
            protocol=protocol.value,
            channels=channels,
            streams=streams,
        )
    )
    cpu_before = server_cpu_s(url) if save_profile else None
    report = run_llm_load_blocking(spec)
    if save_profile is not None:
        save_llm_profile(save_profile, report, spec, devices, cpu_before, url)
    emit(report, json_output, to_json, render)


def save_llm_profile(
    path: Path, report: Any, spec: LLMLoadSpec, devices: int, cpu_before: float | None, url: str
) -> None:
    """`--save-profile`: fit the measured phase (fleetsim/llm_profile.py profile_from_llm_run) and write it;
    the server's CPU from its /metrics at `url`."""
    import socket

    from inferd.fleetsim.llm_profile import profile_from_llm_run

    cpu_after = server_cpu_s(url)
    per_request = None
    if cpu_before is not None and cpu_after is not None and report.sent:
        per_request = (cpu_after - cpu_before) / report.sent
    source = (
        f"measured: inferd bench-llm --model {spec.model} --rate {spec.rate:g} --duration {spec.duration_s:g} "
        f"--prompt-tokens {spec.prompt_tokens} --output-tokens {spec.output_tokens} against {devices} "
        f"device(s) on {socket.gethostname()}; engine budgets: inferd's defaults (edit `scheduler`)"
    )
    name = f"{spec.model}@{socket.gethostname()}"
    profile_from_llm_run(report.measured, name, source, devices, per_request, {}).save(path)
