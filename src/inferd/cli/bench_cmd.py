"""`inferd bench`: offer open-loop load to a running inferd server and check every answer."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from inferd.bench.chaos_spec import ChaosSpec
from inferd.bench.command_line import (
    ArrivalChoice,
    ArrivalCvOption,
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
from inferd.bench.loadgen import LoadSpec, run_load_blocking
from inferd.bench.report import render, to_json
from inferd.bench.spec_checks import default_grpc_target, parse_header
from inferd.fleetsim.profiles import save_measured_profile, server_cpu_s


class ClientChoice(StrEnum):
    raw = "raw"
    aiohttp = "aiohttp"


class ChaosChoice(StrEnum):
    none = "none"
    kill = "kill"
    stop = "stop"


def bench(
    url: Annotated[str, typer.Option(help="Base URL of the inferd server.")] = "http://127.0.0.1:8000",
    model: Annotated[str, typer.Option(help="Model name: requests go to /v2/models/MODEL/infer.")] = "sim",
    protocol: Annotated[
        ProtocolChoice,
        typer.Option(
            help="http: OIP v2 JSON to URL; grpc: Triton's ModelInfer (raw_input_contents, the same "
            "answer check) to --grpc-target."
        ),
    ] = ProtocolChoice.http,
    grpc_target: Annotated[
        str | None,
        typer.Option(help="--protocol grpc: the server's gRPC HOST:PORT (default: URL's host, its port + 1).")
    ] = None,
    channels: Annotated[
        int,
        typer.Option(help="--protocol grpc: gRPC channels (an HTTP/2 connection each) requests take in turn."),
    ] = 4,
    rate: RateOption = 100.0,
    duration: DurationOption = 10.0,
    warmup: WarmupOption = 0.0,
    arrival: ArrivalOption = ArrivalChoice.poisson,
    arrival_cv: ArrivalCvOption = 3.0,
    timeout_ms: Annotated[
        float,
        typer.Option(
            help="Client deadline per request in ms, counted from its intended send time; "
            "a request past it counts as a timeout."
        ),
    ] = 5000.0,
    send_deadline: Annotated[
        bool,
        typer.Option(help="Also send the remaining deadline to the server as X-Request-Timeout-Ms."),
    ] = False,
    priority: PriorityOption = None,
    header: Annotated[
        list[str] | None,
        typer.Option(
            help='Send this header with every request, as "Name: value" (repeatable), e.g. '
            '--header "Authorization: Bearer KEY"; values are never printed.'
        ),
    ] = None,
    payload_bytes: Annotated[
        int,
        typer.Option(help="Size of each request's unique INPUT0 string (padded, never truncated)."),
    ] = 32,
    max_requests: MaxRequestsOption = 1_000_000,
    seed: Annotated[
        int, typer.Option(help="Seed for arrival times; also prefixes request ids and payloads.")
    ] = 0,
    connections: Annotated[
        int,
        typer.Option(
            help="Most TCP connections open at once; past it a request waits for one (and that wait "
            "counts in its latency)."
        ),
    ] = 2000,
    client: Annotated[
        ClientChoice,
        typer.Option(
            help="HTTP client: raw (lean keep-alive HTTP/1.1, plain http only, a few tens of us of CPU "
            "per request) or aiohttp (several times the CPU; speaks https), for comparison."
        ),
    ] = ClientChoice.raw,
    slo_ms: Annotated[
        float | None,
        typer.Option(help="Latency SLO in ms: also report goodput, ok answers within it per second."),
    ] = None,
    chaos: Annotated[
        ChaosChoice,
        typer.Option(
            help="Failure injection during the measured window: every --chaos-interval, send a random "
            "ready local worker of MODEL (from the admin API) SIGKILL (kill) or SIGSTOP (stop; the "
            "server's hang watchdog must replace it, and the tool SIGCONTs it at the end), and time "
            "detection and replacement."
        ),
    ] = ChaosChoice.none,
    chaos_interval: Annotated[float, typer.Option(help="Seconds between injections.")] = 3.0,
    chaos_start: Annotated[
        float | None,
        typer.Option(help="First injection this many seconds into the measured window (default: interval)."),
    ] = None,
    admin_url: Annotated[
        str,
        typer.Option(help="Base URL of the server's admin API (worker list): its HTTP port + 2 unless it set --admin-port."),
    ] = "http://127.0.0.1:8002",
    admin_token: Annotated[
        str | None,
        typer.Option(
            envvar="INFERD_ADMIN_TOKEN",
            show_envvar=True,
            help="Admin API token, sent as 'Authorization: Bearer TOKEN'.",
        ),
    ] = None,
    chaos_seed: Annotated[
        int | None, typer.Option(help="Seed for the choice of victims (default: --seed).")
    ] = None,
    save_profile: Annotated[
        Path | None,
        typer.Option(
            help="Fit a device profile for `inferd fleet-sim` (cost line from the answers' batch sizes and "
            "compute times, overhead, the server's CPU per request from its /metrics) and write it here."
        ),
    ] = None,
    json_output: JsonOption = False,
    histograms: Annotated[
        bool, typer.Option(help="With --json, include the HdrHistogram-encoded latency histogram.")
    ] = False,
) -> None:
    """Offer open-loop load (latency from intended send time) and check every answer's id and digest.

    Exits 1 when any answer was misrouted (another caller's id or a wrong digest) or duplicated (an id
    already answered).
    """
    spec = build_spec(
        lambda: LoadSpec(
            url=url if protocol is ProtocolChoice.http else grpc_target or default_grpc_target(url),
            model=model,
            rate=rate,
            duration_s=duration,
            warmup_s=warmup,
            arrival=arrival.value,
            arrival_cv=arrival_cv,
            timeout_ms=timeout_ms,
            send_deadline=send_deadline,
            priority=priority,
            headers=tuple(parse_header(h) for h in header or ()),
            payload_bytes=payload_bytes,
            max_requests=max_requests,
            seed=seed,
            connections=connections,
            slo_ms=slo_ms,
            client=client.value,
            protocol=protocol.value,
            channels=channels,
        )
    )
    chaos_spec = build_spec(
        lambda: ChaosSpec(
            mode=chaos.value,
            interval_s=chaos_interval,
            start_s=chaos_start,
            admin_url=admin_url,
            admin_token=admin_token,
            seed=seed if chaos_seed is None else chaos_seed,
        )
    )
    cpu_before = server_cpu_s(url) if save_profile else None
    report = run_load_blocking(spec, chaos_spec)
    if save_profile is not None:
        save_measured_profile(save_profile, report, url, model, rate, duration, cpu_before)
    emit(report, json_output, lambda r: to_json(r, include_histograms=histograms), render)
