"""The live console's data: frames sampled from the very registry `/metrics` serves, so the console and a
scrape can never disagree about a number, plus the runtimes' snapshots (models, versions, workers).

A frame is taken every `interval_s` by the server (`run`), a family at a time with the event loop handed
back between families (`take_frame_stepwise`: collecting a registry of many models in one step held every
request of the front end up for 5-30 ms per frame), and kept for `history_s` (15 minutes: a bounded
deque). From two consecutive frames come each model's chart points: requests/s, errors/s, p50/p99 latency
(from the latency histogram's bucket deltas), batch fill, TTFT/ITL p99 and its queue. The JSON a page or
a script reads (`GET /console/data`, docs/console.md) is `page()`: the samples of the families below, as
`/metrics` writes them, taken at the moment of the call, with the models, workers and chart series.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from inferd.clock import Clock
from inferd.runtime.contract import RuntimeStatistics

SHOWN_FAMILIES = (
    "inferd_requests",
    "inferd_requests_rejected",
    "inferd_queue_depth_by_priority",
    "inferd_worker_restarts",
    "inferd_tenant_requests",
    "inferd_quota_decisions",
    "inferd_cache_requests",
    "inferd_traffic_weight",
    "inferd_traffic_rollbacks",
    "inferd_llm_kv_usage_ratio",
    "inferd_llm_prefix_cache_hit_tokens",
    "inferd_llm_prefix_cache_query_tokens",
    "inferd_shadow_requests",
    "inferd_fallback_requests",
    "inferd_model_loads",
    "inferd_model_evictions",
)
"""Families whose samples the page shows as they are (names as prometheus_client reports a family:
a counter without its `_total`). Families of parts that export them are shown when present:"""
SHOWN_PREFIXES = ("inferd_slo_", "inferd_search_")
LATENCY = "inferd_request_duration_seconds"
TTFT = "inferd_time_to_first_token_seconds"
ITL = "inferd_inter_token_latency_seconds"
FILL = "inferd_batch_fill_ratio"
DERIVED_FROM = (LATENCY, TTFT, ITL, FILL, "inferd_requests")
SERIES = ("rps", "errors_ps", "p50_ms", "p99_ms", "fill", "ttft_p99_ms", "itl_p99_ms", "queued")
ERROR_OUTCOMES = frozenset({"error", "failed", "timeout", "rejected"})


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class Frame:
    """Everything the console needs from one instant, as plain values."""

    t: float
    shown: tuple[Sample, ...]
    derived: tuple[Sample, ...]
    runtimes: tuple[RuntimeStatistics, ...]


def shown(family: str) -> bool:
    return family in SHOWN_FAMILIES or family.startswith(SHOWN_PREFIXES)


def take_frame(registry: CollectorRegistry, runtimes: Iterable[RuntimeStatistics], t: float) -> Frame:
    show: list[Sample] = []
    derive: list[Sample] = []
    for family in registry.collect():
        _take(family, show, derive)
    return Frame(t, tuple(show), tuple(derive), tuple(runtimes))


async def take_frame_stepwise(registry: CollectorRegistry, runtimes: Iterable[RuntimeStatistics], t: float) -> Frame:
    """`take_frame`, handing the event loop back after each family the registry collects. Collecting the
    whole registry is one long step otherwise: with 12 models, each with its histograms, 5-30 ms every
    frame during which no request moves on this front end (the largest family, now, is one piece). A
    collector whose `collect` is a generator is resumed after the loop ran: each of ours builds what it
    yields before yielding (prometheus_client's own copy their children under their lock), so none reads
    a dict the loop changes meanwhile."""
    show: list[Sample] = []
    derive: list[Sample] = []
    for family in registry.collect():  # a generator: each family is collected as it is reached
        _take(family, show, derive)
        await asyncio.sleep(0)
    return Frame(t, tuple(show), tuple(derive), tuple(runtimes))


def _take(family: Metric, show: list[Sample], derive: list[Sample]) -> None:
    """The family's samples the page shows (`show`) and the chart points are made from (`derive`)."""
    keep = shown(family.name)
    feeds = family.name in DERIVED_FROM
    if not (keep or feeds):
        return
    for s in family.samples:
        if s.name.endswith("_created"):
            continue
        sample = Sample(s.name, dict(s.labels), s.value)
        if keep:
            show.append(sample)
        if feeds:
            derive.append(sample)


def _sum_by_model(samples: Iterable[Sample], name: str, extra: str | None = None) -> dict[Any, float]:
    """Sum a sample name's values by model (and one more label, e.g. `le`)."""
    out: dict[Any, float] = {}
    for s in samples:
        if s.name != name or "model" not in s.labels:
            continue
        key = s.labels["model"] if extra is None else (s.labels["model"], s.labels.get(extra, ""))
        out[key] = out.get(key, 0.0) + s.value
    return out


def quantile_ms(before: dict[Any, float], after: dict[Any, float], model: str, q: float) -> float | None:
    """The q-quantile (ms) of what a histogram observed between two frames, by linear interpolation
    inside the bucket, as Prometheus' histogram_quantile does; None when nothing was observed."""
    buckets = sorted(
        (math.inf if le == "+Inf" else float(le), after[(m, le)] - before.get((m, le), 0.0))
        for (m, le) in after
        if m == model
    )
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return round(lower * 1000, 3)
            span = count - below
            fraction = 0.0 if span <= 0 else (rank - below) / span
            return round((lower + (upper - lower) * fraction) * 1000, 3)
        lower, below = upper, count
    return None


def model_points(prev: Frame, cur: Frame) -> dict[str, dict[str, float | None]]:
    """Each model's chart point for the interval between two frames."""
    dt = max(cur.t - prev.t, 1e-9)
    a, b = prev.derived, cur.derived
    done_a, done_b = _sum_by_model(a, "inferd_requests_total"), _sum_by_model(b, "inferd_requests_total")
    err_a = _errors(a)
    err_b = _errors(b)
    hist = {
        n: (_sum_by_model(a, n + "_bucket", "le"), _sum_by_model(b, n + "_bucket", "le"))
        for n in (LATENCY, TTFT, ITL)
    }
    fill = [(_sum_by_model(x, FILL + "_sum"), _sum_by_model(x, FILL + "_count")) for x in (a, b)]
    points: dict[str, dict[str, float | None]] = {}
    for rt in cur.runtimes:
        m = rt.name
        point = points.setdefault(m, {"queued": 0.0})
        point["queued"] = (point["queued"] or 0.0) + rt.queued
        point["rps"] = round((done_b.get(m, 0.0) - done_a.get(m, 0.0)) / dt, 3)
        point["errors_ps"] = round((err_b.get(m, 0.0) - err_a.get(m, 0.0)) / dt, 3)
        point["p50_ms"] = quantile_ms(*hist[LATENCY], m, 0.5)
        point["p99_ms"] = quantile_ms(*hist[LATENCY], m, 0.99)
        point["ttft_p99_ms"] = quantile_ms(*hist[TTFT], m, 0.99)
        point["itl_p99_ms"] = quantile_ms(*hist[ITL], m, 0.99)
        count = fill[1][1].get(m, 0.0) - fill[0][1].get(m, 0.0)
        total = fill[1][0].get(m, 0.0) - fill[0][0].get(m, 0.0)
        point["fill"] = round(total / count, 4) if count > 0 else None
    return points


def _errors(samples: Iterable[Sample]) -> dict[str, float]:
    return _sum_by_model(
        (s for s in samples if s.labels.get("outcome") in ERROR_OUTCOMES), "inferd_requests_total"
    )


class ConsoleFeed:
    """Frames every `interval_s`, the last `history_s` of chart points, and the page's JSON."""

    def __init__(
        self,
        registry: CollectorRegistry,
        runtimes: Callable[[], Iterable[RuntimeStatistics]],
        clock: Clock,
        wall: Callable[[], float],
        interval_s: float = 2.0,
        history_s: float = 900.0,
        extras: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.registry = registry
        self.runtimes = runtimes
        self.clock = clock
        self.wall = wall
        """Wall-clock seconds (for the charts' time axis); `clock` measures the intervals."""
        self.interval_s = interval_s
        self.extras = extras
        """More of the page that is not metrics: e.g. tenants' limits and quota use, traffic splits."""
        self.points: deque[tuple[float, dict[str, dict[str, float | None]]]] = deque(
            maxlen=max(1, int(history_s / interval_s))
        )
        self._last: Frame | None = None

    def sample(self) -> None:
        """Take a frame; with a previous one, append the interval's chart points."""
        self._add(take_frame(self.registry, self.runtimes(), self.clock.now()))

    def _add(self, frame: Frame) -> None:
        if self._last is not None:
            self.points.append((round(self.wall(), 3), model_points(self._last, frame)))
        self._last = frame

    async def run(self) -> None:
        """A frame every `interval_s`, taken a family at a time (`take_frame_stepwise`): the requests this
        front end serves meanwhile wait for one family's collection at most, not the registry's."""
        while True:
            self._add(await take_frame_stepwise(self.registry, self.runtimes(), self.clock.now()))
            await asyncio.sleep(self.interval_s)

    def page(self, since: float = 0.0) -> dict[str, Any]:
        """The console's JSON: this instant's samples and snapshots, and the chart points after `since`."""
        frame = take_frame(self.registry, self.runtimes(), self.clock.now())
        return {
            "now": round(self.wall(), 3),
            "interval_s": self.interval_s,
            "models": [_model_row(rt) for rt in frame.runtimes],
            "workers": [_worker_row(w) for rt in frame.runtimes for w in rt.workers],
            "metrics": _grouped(frame.shown),
            "series": self.series(since),
            **(self.extras() if self.extras is not None else {}),
        }

    def series(self, since: float) -> dict[str, dict[str, list[float | None]]]:
        out: dict[str, dict[str, list[float | None]]] = {}
        for t, by_model in self.points:
            if t <= since:
                continue
            for model, point in by_model.items():
                columns = out.setdefault(model, {"t": [], **{k: [] for k in SERIES}})
                columns["t"].append(t)
                for key in SERIES:
                    columns[key].append(point.get(key))
        return out


def _grouped(samples: Iterable[Sample]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        value = s.value if math.isfinite(s.value) else None
        out.setdefault(s.name, []).append({"labels": s.labels, "value": value})
    return out


def _model_row(rt: RuntimeStatistics) -> dict[str, Any]:
    return {
        "name": rt.name,
        "version": rt.version,
        "kind": rt.kind,
        "ready": rt.ready,
        "ready_workers": rt.ready_workers,
        "workers": len(rt.workers),
        "queued": rt.queued,
        "in_flight": rt.in_flight,
    }


def _worker_row(w: Any) -> dict[str, Any]:
    return {
        "worker_id": w.worker_id,
        "model": w.model,
        "version": w.version,
        "state": str(w.state),
        "pid": w.pid,
        "host": w.host,
        "load": w.load,
        "completed": w.completed,
        "busy_s": round(w.busy_s, 3),
        "batch_latency_ms": _latency_ms(w.detail),
    }


def _latency_ms(detail: Any) -> float | None:
    """The batch kind's latency estimate for a worker (other kinds have none)."""
    latency = getattr(detail, "latency_s", None)
    return None if latency is None else round(latency * 1000, 3)
