"""`inferd plan llm`: devices, front ends, cores, memory and cost for an LLM workload under TTFT and ITL
SLOs, from a device profile, checked by simulating a slice (src/inferd/fleetsim/llm_plan.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from inferd.config import ConfigError
from inferd.fleetsim.llm_plan import CHECK_SEEDS, LLMTargets


def plan_llm_cmd(
    rps: Annotated[float, typer.Option(help="Requests per second to serve.")] = 100_000.0,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Prompt tokens per request.")] = 500,
    output_tokens: Annotated[int, typer.Option(min=1, help="Output tokens per request.")] = 200,
    ttft_p99_ms: Annotated[float, typer.Option(help="Target p99 time to first token.")] = 1000.0,
    itl_p99_ms: Annotated[float, typer.Option(help="Target p99 inter-token latency.")] = 100.0,
    device_profile: Annotated[
        Path | None,
        typer.Option(
            help="LLM device profile (inferd bench-llm --save-profile); default: the bundled "
            "published H100 / Llama-3-8B one."
        ),
    ] = None,
    device_cost_per_hour: Annotated[
        float | None, typer.Option(help="Price of one device per hour (prices the plan).")
    ] = None,
    max_utilisation: Annotated[float, typer.Option(help="Of a device's saturation rate.")] = 0.85,
    check: Annotated[
        bool, typer.Option("--check/--no-check", help="Simulate a slice of the plan token by token.")
    ] = True,
    slice_devices: Annotated[int, typer.Option(min=1, help="Devices in the simulated slice.")] = 4,
    shared_devices: Annotated[
        bool,
        typer.Option(
            "--shared-devices/--partitioned-devices",
            help="The deployment planned and simulated: every worker joins every front end (`inferd "
            "worker --connect a,b,...`), or each front end has its own devices.",
        ),
    ] = True,
    seeds: Annotated[
        int, typer.Option(min=1, help="Simulated runs per rate; the rate holds only if every one does.")
    ] = CHECK_SEEDS,
    zones: Annotated[
        int,
        typer.Option(
            min=1,
            help="Zones the fleet spreads over; with 2 or more each zone is sized so that the others "
            "carry the whole load when it is lost (1: no zone's loss planned for).",
        ),
    ] = 1,
    check_seconds: Annotated[
        float, typer.Option(min=1.0, help="Virtual seconds each simulated run lasts.")
    ] = 40.0,
    json_output: Annotated[
        bool, typer.Option("--json", help="The plan as JSON (schema inferd.plan/1).")
    ] = False,
) -> None:
    """The fleet an LLM workload needs, with the arithmetic step by step (docs/capacity.md)."""
    from inferd.cli.fleet_sim_llm import load_llm_profile
    from inferd.fleetsim.llm_plan import plan_llm

    try:
        profile = load_llm_profile(device_profile)
        targets = LLMTargets(
            rps, prompt_tokens, output_tokens, ttft_p99_ms, itl_p99_ms, device_cost_per_hour, max_utilisation
        )
        refuse_unplannable(targets)
        report = plan_llm(
            profile, targets, check, slice_devices, check_seconds, shared_devices=shared_devices, seeds=seeds,
            zones=zones,
        )
    except (ConfigError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    if json_output:
        typer.echo(report.to_json())
        return
    r = report.resources
    typer.echo(f"plan llm: {rps:g} req/s, {prompt_tokens} prompt + {output_tokens} output tokens, "
               f"TTFT p99 <= {ttft_p99_ms:g} ms, ITL p99 <= {itl_p99_ms:g} ms")  # fmt: skip
    typer.echo(f"profile: {report.profile['name']} ({report.profile['source']})")
    typer.echo(f"  devices:      {r.devices:,}  ({r.device_memory_gib:,.0f} GiB of device memory)")
    typer.echo(f"  front ends:   {r.frontends:,}")
    typer.echo(f"  cores:        {r.cores:,}")
    typer.echo(f"  host memory:  {r.memory_gib:,.0f} GiB")
    _echo_zones(report.zones)
    cost = report.cost
    typer.echo(
        "  cost:         " + (f"{cost.per_hour:,.2f}/h, {cost.per_million_tokens} per million output tokens"
                              if cost else "- (pass --device-cost-per-hour)")
    )  # fmt: skip
    typer.echo("reasoning:")
    for i, step in enumerate(report.reasoning, 1):
        typer.echo(f"  {i}. {step}")
    if report.check is not None:
        _echo_check(report.check)


def _echo_zones(z: dict | None) -> None:
    if z is None:
        return
    if not z["survives_zone_loss"]:
        typer.echo("  zones:        1 (no zone's loss planned for; --zones N sizes N zones so N - 1 carry the load)")
        return
    cost = f", {z['headroom_cost_per_hour']:,.2f}/h" if z["headroom_cost_per_hour"] is not None else ""
    typer.echo(
        f"  zones:        {z['zones']}, each {z['devices_per_zone']:,} devices and {z['frontends_per_zone']:,} "
        f"front ends, sized so any {z['zones'] - 1} carry the load"
    )
    typer.echo(
        f"  zone loss:    headroom {z['headroom_devices']:+,} devices ({z['headroom_share']:+.0%} over the "
        f"{z['no_loss_devices']:,} of a plan for no zone's loss{cost}), {z['headroom_frontends']:+,} front ends; "
        f"{z['rate_per_device_all_up']} req/s per device while all are up, {z['rate_per_device_one_lost']} "
        "with one lost"
    )


def _echo_check(check: dict) -> None:
    how = "shared by" if check["shared_devices"] else "split among"
    typer.echo(
        f"check: {check['slice_devices']} devices {how} {check['slice_frontends']} front end(s), "
        f"simulated for {check['duration_s']:g} s with each of {check['seeds']} seed(s) (held: every seed's "
        f"p99s within {check['headroom']:.0%} of the targets, nothing refused, failed or unfinished; the worst seed shown):"
    )
    for run in check["runs"]:
        typer.echo(
            f"  {run['rate_per_device']} req/s/device: TTFT p99 {run['ttft_p99_ms']} ms, ITL p99 "
            f"{run['itl_p99_ms']} ms, attainment {run['slo_attainment']} over {len(run['per_seed'])} "
            f"seed(s), {'held' if run['held'] else 'MISSED'}"
        )


def refuse_unplannable(t: LLMTargets) -> None:
    """ValueError naming the flag, for targets no plan can meet (a rate of 0 would divide by it)."""
    cost = 0.0 if t.device_cost_per_hour is None else t.device_cost_per_hour
    for flag, value, ok, want in [
        ("--rps", t.rps, t.rps > 0, "above 0"),  # each `ok` is False for NaN too
        ("--ttft-p99-ms", t.ttft_p99_ms, t.ttft_p99_ms > 0, "above 0"),
        ("--itl-p99-ms", t.itl_p99_ms, t.itl_p99_ms > 0, "above 0"),
        ("--max-utilisation", t.max_utilisation, 0 < t.max_utilisation <= 1, "within (0, 1]"),
        ("--device-cost-per-hour", cost, cost >= 0, "0 or more"),
    ]:
        if not ok:
            raise ValueError(f"{flag} must be {want}, got {value:g}")
