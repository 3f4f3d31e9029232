"""`inferd fleet-sim llm`: simulate an LLM model's fleet token by token on a virtual clock, with inferd's
own LLMRuntime (placement, prefix-aware routing) and engine scheduler (src/inferd/fleetsim/llm_fleet.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from inferd.bench.llm_workload import LengthDist
from inferd.config import ConfigError
from inferd.fleetsim.arrivals import ArrivalSpec
from inferd.fleetsim.llm_fleet import LLMFleetSpec, simulate_llm
from inferd.fleetsim.llm_profile import BUNDLED, LLMProfile, bundled
from inferd.fleetsim.llm_workload import workload


def load_llm_profile(path: Path | None) -> LLMProfile:
    """A saved profile (`inferd bench-llm --save-profile`), or the bundled published one."""
    return bundled() if path is None else LLMProfile.load(path)


def run_llm(
    devices: Annotated[int, typer.Option(min=1, help="LLM devices (workers).")] = 4,
    frontends: Annotated[int, typer.Option(min=1, help="Front-end processes; arrivals round-robin.")] = 1,
    shared_devices: Annotated[
        bool,
        typer.Option(
            "--shared-devices/--partitioned-devices",
            help="With several front ends: every device serves every front end (the default: as `inferd "
            "serve --frontends N` and `inferd worker --connect a,b,...` run), or each front end has its "
            "own share of the devices.",
        ),
    ] = True,
    rate: Annotated[float, typer.Option(help="Mean arrival rate, requests/s.")] = 40.0,
    arrivals: Annotated[str, typer.Option(help="poisson, gamma, diurnal or trace.")] = "poisson",
    cv: Annotated[float, typer.Option(help="gamma: coefficient of variation of the gaps.")] = 1.0,
    trace: Annotated[Path | None, typer.Option(help='trace: a JSONL file of {"t": seconds} lines.')] = None,
    duration: Annotated[float, typer.Option(help="Virtual seconds of arrivals.")] = 30.0,
    warmup: Annotated[float, typer.Option(help="Virtual seconds left out of the report.")] = 5.0,
    prompt_tokens: Annotated[str, typer.Option(help="N, or LOW-HIGH (uniform).")] = "500",
    output_tokens: Annotated[str, typer.Option(help="N, or LOW-HIGH (uniform).")] = "200",
    shared_prefix: Annotated[int, typer.Option(help="Leading prompt tokens all requests share.")] = 0,
    profile: Annotated[
        Path | None,
        typer.Option(
            help=f"LLM device profile JSON (inferd bench-llm --save-profile); default: {BUNDLED[0]}."
        ),
    ] = None,
    ttft_slo_ms: Annotated[float, typer.Option(help="Goodput SLO on time to first token.")] = 1000.0,
    itl_slo_ms: Annotated[
        float, typer.Option(help="Goodput SLO on each stream's p99 inter-token gap.")
    ] = 100.0,
    seed: int = 0,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Simulate an LLM fleet: TTFT and ITL percentiles, tokens/s, goodput under the SLO."""
    try:
        device = load_llm_profile(profile)
        spec = ArrivalSpec(arrivals, rate, cv, trace=trace, seed=seed)
        times, prompts, outputs = workload(
            spec, duration, LengthDist.parse(prompt_tokens), LengthDist.parse(output_tokens)
        )
    except (ConfigError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    shared_devices = shared_devices and frontends > 1  # one front end has its devices to itself
    fleet = LLMFleetSpec(
        device, devices, times, prompts, outputs, frontends, warmup,
        {"ttft_ms": ttft_slo_ms, "itl_ms": itl_slo_ms}, shared_prefix, seed=seed,
        shared_devices=shared_devices,
    )  # fmt: skip
    started = time.perf_counter()
    report = simulate_llm(fleet)
    out = {
        **report.to_dict(),
        "wall_s": round(time.perf_counter() - started, 2),
        "profile": device.name,
        "profile_source": device.source,
        "shared_devices": shared_devices,
    }
    if json_output:
        typer.echo(json.dumps(out))
        return
    table = Table(
        title=f"fleet-sim llm: {devices} {'shared ' if shared_devices else ''}devices, "
        f"{frontends} front end(s), {arrivals} {rate:g} req/s"
    )
    table.add_column("")
    table.add_column("value", justify="right")
    for key, value in out.items():
        table.add_row(key, str(value))
    Console().print(table)
