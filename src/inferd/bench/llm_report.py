"""What an LLM load run measured: per-stream timings, the goodput rule, the per-phase recorder, the
frozen report, and its rendering as a table or JSON.

Definitions (all times from the request's *intended* send time, so a late generator or a stalled server
shows up as latency, never as a quietly lower offered rate):

* TTFT: arrival of the first SSE chunk (over gRPC: the first ModelStreamInferResponse) that carries text.
* ITL: the gap between consecutive text-carrying chunks. When the server merges several tokens into one
  chunk (a slow reader), that is one gap: ITL is what the client saw.
* TPOT: (e2e - TTFT) / (output tokens - 1), output tokens from the usage chunk; none for one token.
* e2e: arrival of the end of the stream (`data: [DONE]`; over gRPC the response with
  `triton_final_response` true).
* A request is **good** when it is ok (HTTP 200, stream complete, and, when checked, its text is the
  expected one) and TTFT <= ttft_slo and its own p99 ITL <= itl_slo. The per-request p99 is the nearest
  rank: with fewer than 100 gaps it is the request's largest gap; with 100 to 199 gaps the largest may
  exceed the SLO, with 200 to 299 the two largest, and so on.
* Throughputs (requests, output tokens, goodput) are per second of the phase's span: from the start of
  its window to the last completion of one of its requests (at least the window). At an offered load
  the server cannot keep up with, requests finish long after the window and the rates show it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

from hdrh.histogram import HdrHistogram
from rich.console import Console
from rich.table import Table

_LOWEST_US = 1
_HIGHEST_US = 3_600_000_000
_DIGITS = 3
PERCENTILES = (50, 90, 99)
ALWAYS_SHOWN_ERRORS = {
    "http": ("http_429", "http_503", "timeout", "connection", "stream_error", "incomplete"),
    "grpc": ("grpc_resource_exhausted", "grpc_unavailable", "timeout", "connection", "stream_error", "incomplete"),
}
MISMATCH_KINDS = ("wrong_text", "wrong_length", "wrong_id")
"""wrong_id: a gRPC stream answered with another request's id."""


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = 1500.0
    itl_ms: float = 150.0


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """One complete stream. Seconds from the intended send time; `itls_s` are the gaps between chunks."""

    ttft_s: float
    e2e_s: float
    itls_s: tuple[float, ...]
    output_tokens: int

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @classmethod
    def from_chunk_times(cls, chunk_times: Sequence[float], end: float, output_tokens: int) -> StreamTiming:
        """From the arrival times of the text-carrying chunks (at least one) and of the stream's end."""
        gaps = tuple(b - a for a, b in pairwise(chunk_times))
        return cls(chunk_times[0], end, gaps, output_tokens)


def nearest_rank(values: Sequence[float], pct: float) -> float:
    """The nearest-rank percentile: the smallest value with at least pct% of values at or below it."""
    if not values:
        raise ValueError("nearest_rank of no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct * len(ordered) / 100.0) - 1)]


def meets_slo(t: StreamTiming, slo: SLO) -> bool:
    """The goodput rule for an ok stream: TTFT within its SLO, and its own p99 ITL within the ITL SLO."""
    if t.ttft_s * 1000.0 > slo.ttft_ms:
        return False
    return not t.itls_s or nearest_rank(t.itls_s, 99) * 1000.0 <= slo.itl_ms


def _histogram() -> HdrHistogram:
    return HdrHistogram(_LOWEST_US, _HIGHEST_US, _DIGITS)


def _record(h: HdrHistogram, seconds: float) -> None:
    h.record_value(min(_HIGHEST_US, max(_LOWEST_US, round(seconds * 1e6))))


def percentiles_ms(h: HdrHistogram) -> dict[str, float | None]:
    """p50/p90/p99, mean and max of a microsecond histogram, in ms (None when empty)."""
    empty = h.get_total_count() == 0
    values = {} if empty else h.get_percentile_to_value_dict(list(PERCENTILES))
    out: dict[str, float | None] = {f"p{p}": None if empty else values[p] / 1000.0 for p in PERCENTILES}
    out["mean"] = None if empty else h.get_mean_value() / 1000.0
    out["max"] = None if empty else h.get_max_value() / 1000.0
    return out


class LLMRecorder:
    """Counts and histograms for one phase; fixed size whatever the number of requests."""

    def __init__(self, slo: SLO, window_start: float, window_s: float) -> None:
        self.slo = slo
        self.window_start = window_start
        self.window_s = window_s
        self.ttft_us = _histogram()
        self.itl_us = _histogram()
        self.tpot_us = _histogram()
        self.e2e_us = _histogram()
        self.send_lag_us = _histogram()
        self.errors: Counter[str] = Counter()
        self.mismatches: Counter[str] = Counter()
        self.sent = 0
        self.ok_count = 0
        self.good = 0
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.last_end = window_start
        self.ttft_fit = [0.0] * 5
        """n, sum x, sum y, sum xx, sum xy of (prompt tokens, TTFT s): its least-squares line is what
        `--save-profile` takes the per-token cost from."""

    def send_lag(self, lag_s: float) -> None:
        self.sent += 1
        _record(self.send_lag_us, max(0.0, lag_s))

    def error(self, kind: str) -> None:
        self.errors[kind] += 1

    def mismatch(self, kind: str) -> None:
        self.mismatches[kind] += 1

    def ok(self, t: StreamTiming, prompt_tokens: int, ended_at: float) -> None:
        """An ok stream (checked, if checking): its timings, tokens and whether it met the SLO."""
        self.ok_count += 1
        self.output_tokens += t.output_tokens
        self.prompt_tokens += prompt_tokens
        self.last_end = max(self.last_end, ended_at)
        _record(self.ttft_us, t.ttft_s)
        _record(self.e2e_us, t.e2e_s)
        fit = self.ttft_fit
        fit[0] += 1
        fit[1] += prompt_tokens
        fit[2] += t.ttft_s
        fit[3] += prompt_tokens * prompt_tokens
        fit[4] += prompt_tokens * t.ttft_s
        for gap in t.itls_s:
            _record(self.itl_us, gap)
        tpot = t.tpot_s
        if tpot is not None:
            _record(self.tpot_us, tpot)
        if meets_slo(t, self.slo):
            self.good += 1

    @property
    def span_s(self) -> float:
        return max(self.window_s, self.last_end - self.window_start)


@dataclass(frozen=True)
class LLMPhaseReport:
    """One phase's numbers; latencies of ok streams in ms, rates per second of `span_s`."""

    window_s: float
    span_s: float
    sent: int
    offered_rps: float
    ok: int
    good: int
    slo: dict[str, float]
    slo_attainment: float | None
    """good / sent."""
    goodput_rps: float
    request_rps: float
    output_tokens: int
    output_tokens_per_s: float
    prompt_tokens: int
    mismatched: int
    mismatch_kinds: dict[str, int]
    errors: dict[str, int]
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    send_lag_ms: dict[str, float | None]
    ttft_fit: tuple[float, ...] = ()
    """n, sum x, sum y, sum xx, sum xy of the ok streams' (prompt tokens, TTFT seconds)."""

    @classmethod
    def from_recorder(cls, rec: LLMRecorder) -> LLMPhaseReport:
        span = rec.span_s
        return cls(
            window_s=rec.window_s,
            span_s=span,
            sent=rec.sent,
            offered_rps=rec.sent / rec.window_s,
            ok=rec.ok_count,
            good=rec.good,
            slo=asdict(rec.slo),
            slo_attainment=rec.good / rec.sent if rec.sent else None,
            goodput_rps=rec.good / span,
            request_rps=rec.ok_count / span,
            output_tokens=rec.output_tokens,
            output_tokens_per_s=rec.output_tokens / span,
            prompt_tokens=rec.prompt_tokens,
            mismatched=sum(rec.mismatches.values()),
            mismatch_kinds={kind: rec.mismatches[kind] for kind in MISMATCH_KINDS},
            errors=dict(sorted(rec.errors.items())),
            ttft_ms=percentiles_ms(rec.ttft_us),
            itl_ms=percentiles_ms(rec.itl_us),
            tpot_ms=percentiles_ms(rec.tpot_us),
            e2e_ms=percentiles_ms(rec.e2e_us),
            send_lag_ms=percentiles_ms(rec.send_lag_us),
            ttft_fit=tuple(rec.ttft_fit),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LLMLoadReport:
    spec: dict[str, Any]
    scheduled: int
    sent: int
    elapsed_s: float
    generator_cpu_s: float
    measured: LLMPhaseReport
    warmup: LLMPhaseReport | None

    @property
    def mismatched_total(self) -> int:
        """Mismatches in every phase: a wrong stream during warmup is still a wrong stream."""
        return self.measured.mismatched + (self.warmup.mismatched if self.warmup else 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "scheduled": self.scheduled,
            "sent": self.sent,
            "elapsed_s": self.elapsed_s,
            "generator_cpu_s": self.generator_cpu_s,
            "mismatched_total": self.mismatched_total,
            "measured": self.measured.to_dict(),
            "warmup": self.warmup.to_dict() if self.warmup else None,
        }


def to_json(report: LLMLoadReport) -> str:
    return json.dumps(report.to_dict(), indent=2)


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _dist(d: dict[str, float | None]) -> str:
    return " / ".join(_f(d[k]) for k in ("p50", "p90", "p99", "max"))


def _rows(p: LLMPhaseReport, protocol: str) -> list[tuple[str, str, bool]]:
    attainment = "-" if p.slo_attainment is None else f"{100 * p.slo_attainment:.1f}%"
    slo = f"TTFT <= {p.slo['ttft_ms']:g} ms, p99 ITL <= {p.slo['itl_ms']:g} ms"
    kinds = ", ".join(f"{k} {v}" for k, v in p.mismatch_kinds.items())
    errors = {kind: p.errors.get(kind, 0) for kind in ALWAYS_SHOWN_ERRORS[protocol]} | p.errors
    rows = [
        ("offered", f"{p.offered_rps:,.2f} req/s ({p.sent:,} sent in {p.window_s:g} s)", False),
        (f"goodput ({slo})", f"{p.goodput_rps:,.2f} req/s ({p.good:,} good, {attainment})", False),
        ("throughput", f"{p.request_rps:,.2f} req/s, {p.output_tokens_per_s:,.0f} output tokens/s", False),
        ("span (window start to last completion)", f"{p.span_s:,.1f} s", False),
        ("ok", f"{p.ok:,}", False),
        ("mismatched", f"{p.mismatched:,} ({kinds})", p.mismatched > 0),
        *((f"error {k}", f"{v:,}", v > 0) for k, v in errors.items()),
        ("TTFT ms p50/p90/p99/max", _dist(p.ttft_ms), False),
        ("ITL ms p50/p90/p99/max", _dist(p.itl_ms), False),
        ("TPOT ms p50/p90/p99/max", _dist(p.tpot_ms), False),
        ("e2e ms p50/p90/p99/max", _dist(p.e2e_ms), False),
        ("send lag ms p99/max", f"{_f(p.send_lag_ms['p99'])} / {_f(p.send_lag_ms['max'])}", False),
    ]
    return rows


def render(report: LLMLoadReport, console: Console | None = None) -> None:
    spec = report.spec
    protocol = spec.get("protocol", "http")
    title = (
        f"inferd bench-llm: {spec['arrival']} {spec['rate']:g} req/s -> {spec['url']} ({protocol}) "
        f"model {spec['model']}, "
        f"prompt {spec['prompt_tokens']} / output {spec['output_tokens']} tokens"
    )
    table = Table(title=title)
    table.add_column("measured window", style="bold")
    table.add_column("value", justify="right")
    for name, value, bad in _rows(report.measured, protocol):
        table.add_row(name, value, style="bold red" if bad else None)
    if report.warmup is not None:
        w = report.warmup
        table.add_row("warmup (excluded)", f"{w.sent:,} sent, {w.ok:,} ok, {w.mismatched:,} mismatched")
    table.add_row("unsent at hard stop", f"{report.scheduled - report.sent:,}")
    table.add_row("generator CPU", f"{report.generator_cpu_s:.2f} s")
    (console or Console()).print(table)
