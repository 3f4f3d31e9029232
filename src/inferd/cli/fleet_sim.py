"""`inferd fleet-sim`: simulate a fleet on a virtual clock with inferd's own runtime and policies
(src/inferd/fleetsim/), and `validate` the simulator against real runs on this machine."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from inferd.config import ConfigError
from inferd.config.autoscaler import AutoscalerConfig
from inferd.config.tenants import TenantConfig
from inferd.fleetsim.arrivals import ArrivalSpec, arrival_times
from inferd.fleetsim.batch_fleet import Failure, FleetSpec, simulate
from inferd.fleetsim.profiles import BatchProfile
from inferd.fleetsim.tenants import SimTenant
from inferd.models.sim import sim_config

fleet_sim_app = typer.Typer(help=__doc__, no_args_is_help=True)


def parse_failure(kind: str, raw: str) -> Failure:
    """'VALUE@SECONDS': kill 0.1@20 (a share of the devices), slow 10@5 (one device's slowdown),
    lose-frontend 0@30 (a front end's index), lose-zone 1@30 and heal-zone 1@45 (a zone's index)."""
    value, sep, at = raw.partition("@")
    try:
        number, at_s = float(value), float(at)
    except ValueError:
        raise typer.BadParameter(f"--{kind} takes VALUE@SECONDS, e.g. 0.1@20; got {raw!r}") from None
    if not sep or at_s < 0:
        raise typer.BadParameter(f"--{kind} takes VALUE@SECONDS with SECONDS >= 0; got {raw!r}")
    if kind == "kill":
        return Failure("kill", at_s, fraction=number)
    if kind == "slow":
        return Failure("slow", at_s, factor=number)
    if kind in ("lose-zone", "heal-zone") and (not number.is_integer() or number < 0):
        raise typer.BadParameter(f"--{kind} takes ZONE_INDEX@SECONDS (0 is zone-a); got {raw!r}")
    return Failure(kind.replace("-", "_"), at_s, index=int(number))


def parse_tenant(raw: str) -> SimTenant:
    parts = raw.split(":")
    try:
        name, share = parts[0], float(parts[1])
        rate = float(parts[2]) if len(parts) > 2 and parts[2] else None
        burst = int(parts[3]) if len(parts) > 3 and parts[3] else None
        weight = float(parts[4]) if len(parts) > 4 and parts[4] else 1.0
        return SimTenant(name, share, TenantConfig(requests_per_s=rate, burst=burst, weight=weight))
    except (IndexError, ValueError) as exc:
        raise typer.BadParameter(
            f"--tenant takes NAME:SHARE[:REQUESTS_PER_S[:BURST[:WEIGHT]]]; got {raw!r} ({exc})"
        ) from None


@fleet_sim_app.command()
def run(
    devices: Annotated[int, typer.Option(min=1, help="Devices (workers).")] = 4,
    frontends: Annotated[
        int, typer.Option(min=1, help="Front-end processes; arrivals split round-robin.")
    ] = 1,
    shared_devices: Annotated[
        bool,
        typer.Option(
            "--shared-devices/--partitioned-devices",
            help="With several front ends: every device serves every front end, under its batch credits "
            "(the default: as `inferd serve --frontends N` and `inferd worker --connect a,b,...` run), or "
            "each front end has its own share of the devices.",
        ),
    ] = True,
    rate: Annotated[float, typer.Option(help="Mean arrival rate, requests/s.")] = 1000.0,
    arrivals: Annotated[str, typer.Option(help="poisson, gamma, diurnal or trace.")] = "poisson",
    cv: Annotated[float, typer.Option(help="gamma: coefficient of variation of the gaps.")] = 1.0,
    amplitude: Annotated[float, typer.Option(help="diurnal: relative swing of the rate.")] = 0.5,
    period_s: Annotated[float, typer.Option(help="diurnal: period in seconds.")] = 60.0,
    trace: Annotated[Path | None, typer.Option(help='trace: a JSONL file of {"t": seconds} lines.')] = None,
    duration: Annotated[float, typer.Option(help="Virtual seconds of arrivals.")] = 30.0,
    warmup: Annotated[float, typer.Option(help="Virtual seconds left out of the report.")] = 2.0,
    profile: Annotated[
        Path | None, typer.Option(help="Device profile JSON (inferd bench --save-profile).")
    ] = None,
    base_ms: Annotated[float, typer.Option(help="Without --profile: a batch's fixed cost.")] = 20.0,
    per_item_ms: Annotated[float, typer.Option(help="Without --profile: each item's cost.")] = 0.1,
    max_batch_size: Annotated[int, typer.Option(min=1)] = 100,
    max_wait_ms: Annotated[float, typer.Option(min=0.0)] = 10.0,
    max_queue_size: Annotated[int | None, typer.Option(min=1, help="Default: 4 full batches.")] = None,
    kill: Annotated[
        list[str] | None, typer.Option(help="SHARE@SECONDS: kill that share of the devices.")
    ] = None,
    slow: Annotated[
        list[str] | None, typer.Option(help="FACTOR@SECONDS: one device becomes that much slower.")
    ] = None,
    lose_frontend: Annotated[
        list[str] | None, typer.Option(help="INDEX@SECONDS: that front end dies.")
    ] = None,
    zones: Annotated[
        int,
        typer.Option(
            min=0,
            help="Spread front ends, devices and clients over this many zones (zone-a, zone-b, ...; "
            "front end and device i in zone i % N): each front end routes to its zone first, as the "
            "server does (needs --frontends >= N, shared devices). 0: no zones.",
        ),
    ] = 0,
    overprovisioning: Annotated[
        float, typer.Option(min=1.0, help="With --zones: [cluster] overprovisioning of every front end.")
    ] = 1.4,
    lose_zone: Annotated[
        list[str] | None,
        typer.Option(help="INDEX@SECONDS: that zone (0: zone-a) loses its front ends and devices at once."),
    ] = None,
    heal_zone: Annotated[
        list[str] | None, typer.Option(help="INDEX@SECONDS: that lost zone comes back.")
    ] = None,
    autoscale: Annotated[
        bool, typer.Option(help="Run the server's autoscaler on the fleet (one front end).")
    ] = False,
    min_devices: Annotated[int, typer.Option(min=0, help="--autoscale: fewest devices.")] = 1,
    max_devices: Annotated[int, typer.Option(min=1, help="--autoscale: most devices.")] = 8,
    tenant: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME:SHARE[:REQUESTS_PER_S[:BURST[:WEIGHT]]] (repeatable): who sends the arrivals."
        ),
    ] = None,
    seed: int = 0,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Simulate a batch model's fleet: throughput, latency percentiles, outcomes, mean batch size."""
    logging.getLogger("inferd").setLevel(
        logging.ERROR
    )  # the runtime's own lines (workers lost...) are expected here
    try:
        device = (
            BatchProfile.load(profile)
            if profile is not None
            else BatchProfile(
                "given", base_ms / 1000, per_item_ms / 1000, source="given: --base-ms/--per-item-ms"
            )
        )
        times = arrival_times(ArrivalSpec(arrivals, rate, cv, amplitude, period_s, trace, seed), duration)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    overrides = {} if max_queue_size is None else {"max_queue_size": max_queue_size}
    model = sim_config(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, **overrides)
    failures = [
        parse_failure(k, raw)
        for k, values in (
            ("kill", kill), ("slow", slow), ("lose-frontend", lose_frontend), ("lose-zone", lose_zone),
            ("heal-zone", heal_zone),
        )
        for raw in values or ()
    ]  # fmt: skip
    if any("zone" in f.kind for f in failures) and not zones:
        raise typer.BadParameter("--lose-zone and --heal-zone need --zones")
    if autoscale and frontends != 1:
        raise typer.BadParameter("--autoscale simulates one front end: drop --frontends or --autoscale")
    scaling = AutoscalerConfig(min_workers=min_devices, max_workers=max_devices) if autoscale else None
    spec = FleetSpec(
        model,
        device,
        devices,
        times,
        frontends,
        warmup,
        failures=failures,
        seed=seed,
        autoscale=scaling,
        shared_devices=shared_devices,
        zones=zones,
        overprovisioning=overprovisioning,
    )
    spec.tenants = [parse_tenant(raw) for raw in tenant or ()]
    shared_devices = spec.shares_devices  # one front end has its devices to itself
    started = time.perf_counter()
    try:
        report = simulate(spec)
    except ValueError as exc:  # a layout the fleet cannot take (zones without a front end each)
        raise typer.BadParameter(str(exc)) from None
    wall = time.perf_counter() - started
    out = {
        **report.to_dict(),
        "shared_devices": shared_devices,
        "wall_s": round(wall, 2),
        "profile": device.name,
        "profile_source": device.source,
    }
    if json_output:
        typer.echo(json.dumps(out))
        return
    kind = "shared " if shared_devices else ""
    table = Table(
        title=f"fleet-sim: {devices} {kind}devices, {frontends} front end(s), {arrivals} {rate:g} req/s"
    )
    table.add_column("")
    table.add_column("value", justify="right")
    for key, value in out.items():
        if key != "zones":
            table.add_row(key, str(value))
    Console().print(table)
    if report.zones is not None:
        Console().print(_zones_table(report.zones))


def _zones_table(zones: dict) -> Table:
    """Per client zone (and all of them): the measured window, then each phase around a zone's loss."""
    table = Table(title=f"zones (overprovisioning {zones['overprovisioning']:g}): clients of each zone")
    for header in ("zone", "arrived", "requests", "goodput/s", "failed", "429", "timeouts", "p99 ms",
                   "in-zone", "via other zone"):  # fmt: skip
        table.add_column(header, justify="right")
    for name, z in zones.items():
        if not isinstance(z, dict):
            continue
        for when, f in [("measured", z), *((f"{p['from_s']:g}-{p['to_s']:.4g} s", p) for p in z.get("phases", []))]:
            table.add_row(
                name, when, str(f["requests"]), f"{f['goodput_rps']:g}", str(f["failed"]), str(f["rejected"]),
                str(f["timeouts"]), str(f["p99_ms"]), "-" if f["in_zone_share"] is None else f"{f['in_zone_share']:.1%}",
                str(f.get("via_other_zone", "-")),
            )  # fmt: skip
    return table


@fleet_sim_app.command()
def validate(
    quick: Annotated[
        bool,
        typer.Option("--quick", help="A reduced set (sim at 1 and 2 workers; no sim-llm), a few minutes."),
    ] = False,
    duration: Annotated[float, typer.Option(help="Measured seconds of each real run.")] = 12.0,
    warmup: Annotated[float, typer.Option(help="Warmup seconds of each run.")] = 2.0,
    json_output: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Run small cases for real and simulated; exit 1 when a case is outside its tolerance
    (throughput 5%, p99 20%: of latency for sim, of whole-request latency for sim-llm)."""
    from inferd.fleetsim.validate import to_json
    from inferd.fleetsim.validate import validate as run_validation
    from inferd.fleetsim.validate_llm import validate_llm

    results = run_validation(quick, duration, warmup) + ([] if quick else validate_llm(duration, warmup))
    if json_output:
        typer.echo(to_json(results))
    else:
        table = Table(title="fleet-sim validate: real vs simulated")
        for header in (
            "case",
            "load",
            "rate",
            "real rps",
            "sim rps",
            "err",
            "real p99",
            "sim p99",
            "err",
            "real batch",
            "sim batch",
            "ok",
        ):
            table.add_column(header, justify="right")
        for r in results:
            table.add_row(
                r.case, f"{r.load:.0%}", f"{r.rate:g}", f"{r.real_rps:g}", f"{r.sim_rps:g}", f"{r.throughput_error:.1%}",
                f"{r.real_p99_ms}", f"{r.sim_p99_ms}", "-" if r.p99_error is None else f"{r.p99_error:.1%}",
                f"{r.real_batch}", f"{r.sim_batch}", "yes" if r.ok else "NO",
            )  # fmt: skip
        Console().print(table)
    if not all(r.ok for r in results):
        raise typer.Exit(1)


def _register_llm() -> None:
    from inferd.cli.fleet_sim_llm import run_llm

    fleet_sim_app.command("llm")(run_llm)


_register_llm()
