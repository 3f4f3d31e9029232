"""What `inferd bench` and `inferd bench-llm` share on the command line: the options both take (each
command sets its own defaults), turning a bad spec into a usage error, and printing the report with
the exit code it calls for."""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Protocol, TypeVar

import typer


class ProtocolChoice(StrEnum):
    http = "http"
    grpc = "grpc"


class ArrivalChoice(StrEnum):
    poisson = "poisson"
    constant = "constant"
    gamma = "gamma"


RateOption = Annotated[float, typer.Option(help="Offered load in requests per second (open loop).")]
DurationOption = Annotated[
    float, typer.Option(help="Seconds of the measured window (intended send times, after warmup).")
]
WarmupOption = Annotated[
    float, typer.Option(help="Seconds of load offered first; its results are not in the numbers.")
]
ArrivalOption = Annotated[
    ArrivalChoice,
    typer.Option(
        help="Arrival process: poisson (exponential gaps), constant (evenly spaced) or gamma (gamma gaps "
        "with --arrival-cv, e.g. 3 for bursts)."
    ),
]
ArrivalCvOption = Annotated[
    float, typer.Option(help="gamma arrivals: coefficient of variation of the gaps (1 is Poisson).")
]
MaxRequestsOption = Annotated[int, typer.Option(help="Hard cap on requests sent, warmup included.")]
PriorityOption = Annotated[str | None, typer.Option(help="Send this value as the X-Priority header.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of a table.")]

S = TypeVar("S")


class _Report(Protocol):
    @property
    def mismatched_total(self) -> int: ...


R = TypeVar("R", bound=_Report)


def build_spec(make: Callable[[], S]) -> S:
    """The spec `make` builds; its ValueError (an invalid combination of options) as a usage error."""
    try:
        return make()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


def emit(report: R, as_json: bool, to_json: Callable[[R], str], render: Callable[[R], None]) -> None:
    """Print the report (JSON or a table); exit 1 when any answer was wrong."""
    if as_json:
        typer.echo(to_json(report))
    else:
        render(report)
    if report.mismatched_total > 0:
        raise typer.Exit(code=1)
