"""What a simulated LLM run measured, over the requests that arrived in the measured window (after
warmup), with `inferd bench-llm`'s definitions (bench/llm_report.py):

* TTFT: arrival to the first token (plus the profile's serving overhead);
* ITL: the gap between consecutive tokens of a stream, over every gap of every ok stream;
* e2e: arrival to the last token (plus the overhead);
* good: an ok stream with TTFT <= the TTFT SLO whose own p99 ITL (nearest rank) is <= the ITL SLO;
* rates are per second of the span: from the window's start to the last completion of one of its
  requests (at least the window).
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

_DECADES = (-5, 3)
_PER_DECADE = 1000


class LLMOutcome(enum.IntEnum):
    PENDING = 0
    OK = 1
    REJECTED = 2
    """429 at submission: no worker's engine would queue the sequence."""
    FAILED = 3
    """The stream failed (worker lost and not moved, deadline, error)."""


class GapHistogram:
    """Inter-token gaps in log-spaced bins (0.23% wide, 10 us to 1000 s): fixed size however many tokens."""

    def __init__(self) -> None:
        self.counts = np.zeros((_DECADES[1] - _DECADES[0]) * _PER_DECADE + 1, dtype=np.int64)
        self.buffer: list[float] = []

    def flush(self) -> None:
        if not self.buffer:
            return
        values = np.maximum(np.asarray(self.buffer), 10.0 ** _DECADES[0])
        index = np.clip(
            ((np.log10(values) - _DECADES[0]) * _PER_DECADE).astype(np.int64), 0, self.counts.size - 1
        )
        self.counts += np.bincount(index, minlength=self.counts.size)
        self.buffer = []

    def percentiles_ms(self, qs: tuple[float, ...]) -> list[float | None]:
        self.flush()
        total = int(self.counts.sum())
        if not total:
            return [None] * len(qs)
        cumulative = np.cumsum(self.counts)
        out: list[float | None] = []
        for q in qs:
            i = int(np.searchsorted(cumulative, math.ceil(q / 100 * total)))
            out.append(round(1000 * 10 ** (_DECADES[0] + (i + 1) / _PER_DECADE), 3))  # the bin's upper edge
        return out


@dataclass(frozen=True, slots=True)
class LLMSimReport:
    offered_rps: float
    throughput_rps: float
    goodput_rps: float
    slo_attainment: float | None
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    requests: int
    ok: int
    good: int
    rejected: int
    failed: int
    unfinished: int
    steps: int
    mean_step_tokens: float
    mean_step_ms: float
    preemptions: int
    slo: dict[str, float]
    events: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _r(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


def build_report(run: Any, warmup_s: float, window_end_s: float) -> LLMSimReport:
    """`run`: a finished llm_fleet.LLMFleet."""
    arrivals = run.spec.arrivals
    window = arrivals >= warmup_s
    outcome = np.asarray(run.outcome, dtype=np.int8)
    first = np.asarray(run.first_at)
    last = np.asarray(run.last_at)
    overhead = run.spec.profile.overhead_s
    ok = window & (outcome == LLMOutcome.OK)
    ttft = (first - arrivals + overhead)[ok] * 1000
    e2e = (last - arrivals + overhead)[ok] * 1000
    tokens = np.asarray(run.tokens)[ok]
    gaps = np.maximum(tokens - 1, 0)
    over = np.asarray(run.over)[ok]
    allowed = gaps - np.ceil(0.99 * gaps)  # gaps a request may have over the ITL SLO (nearest rank)
    slo = run.spec.slo
    good = int(((ttft <= slo["ttft_ms"]) & (over <= allowed)).sum())
    window_s = max(1e-9, window_end_s - warmup_s)
    span = max(window_s, float(last[ok].max()) - warmup_s) if ok.any() else window_s
    t = np.percentile(ttft, [50, 90, 99]) if ttft.size else [None] * 3
    e = np.percentile(e2e, [50, 99]) if e2e.size else [None] * 2
    itl = run.gaps.percentiles_ms((50, 90, 99))
    requests = int(window.sum())
    return LLMSimReport(
        offered_rps=round(requests / window_s, 3),
        throughput_rps=round(int(ok.sum()) / span, 3),
        goodput_rps=round(good / span, 3),
        slo_attainment=round(good / requests, 4) if requests else None,
        output_tokens_per_s=round(float(tokens.sum()) / span, 1),
        ttft_p50_ms=_r(t[0]),
        ttft_p90_ms=_r(t[1]),
        ttft_p99_ms=_r(t[2]),
        itl_p50_ms=itl[0],
        itl_p90_ms=itl[1],
        itl_p99_ms=itl[2],
        e2e_p50_ms=_r(e[0]),
        e2e_p99_ms=_r(e[1]),
        requests=requests,
        ok=int(ok.sum()),
        good=good,
        rejected=int((window & (outcome == LLMOutcome.REJECTED)).sum()),
        failed=int((window & (outcome == LLMOutcome.FAILED)).sum()),
        unfinished=int((window & (outcome == LLMOutcome.PENDING)).sum()),
        steps=run.steps,
        mean_step_tokens=round(run.step_tokens / run.steps, 2) if run.steps else 0.0,
        mean_step_ms=round(1000 * run.step_seconds / run.steps, 3) if run.steps else 0.0,
        preemptions=run.preemptions(),
        slo=dict(slo),
        events=run.events.processed,
    )
