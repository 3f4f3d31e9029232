"""The per-model `slo` setting: the service level objectives inferd counts good and bad events for,
exports burn rates of, and writes alerting rules for (`inferd slo rules`).

    [slo]                       # in model.toml, or [models.NAME.slo] in the --config file
    availability = 0.999        # share of requests answered without a server-side failure
    latency_ms = 200            # a successful request is fast when it took at most this long...
    latency_target = 0.99       # ...and this share of successful requests must be fast
    ttft_ms = 500               # LLM models: time to first token (same target)
    itl_ms = 50                 # LLM models: time between tokens (same target)

Kept apart from the SLO accounting (it imports only pydantic) so config.py can import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

SLO_NAMES = ("availability", "latency", "ttft", "itl")
"""Every SLO a model may have, in the order rules and dashboards list them."""
LATENCY_SLOS = ("latency", "ttft", "itl")
"""The SLOs whose events are durations compared with a threshold."""


@dataclass(frozen=True, slots=True)
class Objective:
    """One SLO of one model: the share of events that must be good, and (latency SLOs) the threshold."""

    slo: str
    target: float
    threshold_s: float | None = None

    @property
    def error_budget(self) -> float:
        """The share of events allowed to be bad."""
        return 1.0 - self.target


def _in_open_unit(name: str, value: float, example: str) -> float:
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"{name} = {value} must lie strictly between 0 and 1 (a share of events; 1 leaves no error "
            f"budget): use e.g. {example}"
        )
    return value


def _positive_ms(name: str, value: float | None) -> float | None:
    if value is not None and not value > 0.0:
        raise ValueError(f"{name} = {value} must be a positive number of milliseconds, e.g. {name} = 200")
    return value


class SloConfig(BaseModel):
    """Service level objectives of one model; every served version counts towards the same ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    availability: float = 0.999
    """Share of requests that must not fail on the server's side (5xx, 504 deadlines, overload 429s).
    A tenant's quota 429s, other 4xx and clients that went away are not events."""
    latency_ms: float = 200.0
    """A successful request is good when its response (a stream: its last byte) took at most this long;
    LLM models take a whole generation's budget here, and judge the stream with ttft_ms and itl_ms."""
    latency_target: float = 0.99
    """Share of latency (and ttft, itl) events that must be good."""
    ttft_ms: float | None = None
    """LLM models: a stream is good when its first token came within this long of the request."""
    itl_ms: float | None = None
    """LLM models: a token is good when it came within this long of the one before."""
    shed_lost: bool = False
    """With `batching = "slo"`: a queued interactive request that can no longer be answered within
    latency_ms (it would miss it even in a batch of its own started now) and was never sent to a worker
    is answered at once with 429 and Retry-After (reason slo_lost) instead of waiting for a lull, so it
    holds no place in the queue and its client learns at once. Like every overload 429 it counts
    against availability (a late answer counts against latency instead)."""

    @field_validator("availability")
    @classmethod
    def _availability(cls, value: float) -> float:
        return _in_open_unit("availability", value, "availability = 0.999")

    @field_validator("latency_target")
    @classmethod
    def _latency_target(cls, value: float) -> float:
        return _in_open_unit("latency_target", value, "latency_target = 0.99")

    @field_validator("latency_ms", "ttft_ms", "itl_ms")
    @classmethod
    def _thresholds(cls, value: float | None, info: ValidationInfo) -> float | None:
        return _positive_ms(info.field_name or "latency_ms", value)

    def check_kind(self, kind: str, streaming: frozenset[str]) -> None:
        """ttft_ms and itl_ms are read only for models that stream tokens: of the `streaming` kinds (the
        KindRegistry's `Kind.streams_tokens`; this layer knows no kinds)."""
        given = [name for name in ("ttft_ms", "itl_ms") if getattr(self, name) is not None]
        if given and kind not in streaming:
            of = " or ".join(f'"{k}"' for k in sorted(streaming))
            raise ValueError(
                f"slo {' and '.join(given)} apply to LLM models (kind = {of}), this model's kind is "
                f"{kind!r}: remove {', '.join(given)} from its [slo] table, or use latency_ms"
            )

    def check_batching(self) -> None:
        """`batching = "slo"` sizes batches from latency_ms: a default nobody chose is not enough."""
        if "latency_ms" not in self.model_fields_set:
            raise ValueError(
                'batching = "slo" sizes batches from the latency SLO, and this model\'s [slo] table sets no '
                'latency_ms: add one, e.g. slo = { latency_ms = 100 }, or use batching = "fixed"'
            )

    def objectives(self) -> tuple[Objective, ...]:
        """The SLOs this table sets, in SLO_NAMES order."""
        found = [Objective("availability", self.availability)]
        thresholds = {"latency": self.latency_ms, "ttft": self.ttft_ms, "itl": self.itl_ms}
        for slo in LATENCY_SLOS:
            ms = thresholds[slo]
            if ms is not None:
                found.append(Objective(slo, self.latency_target, ms / 1000.0))
        return tuple(found)


def check_slo_batching(batching: str, slo: SloConfig | None) -> None:
    """A model with `batching = "slo"` needs an [slo] table that sets latency_ms; shed_lost needs it."""
    if batching != "slo":
        if slo is not None and slo.shed_lost:
            raise ValueError(
                "slo shed_lost = true sheds the requests SLO batching gives up on; it applies to batch models "
                'with batching = "slo": set that, or remove shed_lost'
            )
        return
    if slo is None:
        raise ValueError(
            'batching = "slo" sizes batches from the latency SLO, and this model has no [slo] table: add '
            'one with latency_ms, e.g. slo = { latency_ms = 100 }, or use batching = "fixed"'
        )
    slo.check_batching()


class ServedVersion(Protocol):
    """What model_slos reads of a ModelConfig."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def slo(self) -> SloConfig | None: ...


def model_slos(models: Iterable[ServedVersion]) -> dict[str, SloConfig]:
    """Model name -> its SLO table, for the models (ModelConfig, one per served version) that set one.
    Versions of a model share its SLOs: the highest version's table is the model's."""
    found: dict[str, tuple[int, SloConfig]] = {}
    for m in models:
        slo = m.slo
        if slo is not None and (m.name not in found or m.version > found[m.name][0]):
            found[m.name] = (m.version, slo)
    return {name: slo for name, (_, slo) in sorted(found.items())}


def thresholds_s(slos: dict[str, SloConfig], slo: str) -> tuple[float, ...]:
    """Every configured threshold of one latency SLO, in seconds (each becomes a histogram bucket)."""
    values = {o.threshold_s for s in slos.values() for o in s.objectives() if o.slo == slo}
    return tuple(sorted(v for v in values if v is not None))
