"""Prometheus metrics. Names: inferd_<component>_<thing>_<unit>, base units, bounded labels.

Per-request paths use pre-bound label children (one dict lookup, one lock) so metrics stay cheap at
thousands of requests per second.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector

from inferd.clock import Clock, MonotonicClock
from inferd.observability.cache_metrics import CacheMetrics
from inferd.observability.slo import SloMetrics
from inferd.observability.slo_config import SloConfig, thresholds_s
from inferd.observability.traffic_metrics import TrafficMetrics

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100, 128, 256, 512, 1024, 4096)
COLD_START_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def latency_buckets(slos: Mapping[str, SloConfig], slo: str) -> tuple[float, ...]:
    """LATENCY_BUCKETS plus a bucket at exactly each configured threshold of `slo`, so a histogram
    answers "what share was within the SLO" without interpolation."""
    return tuple(sorted(set(LATENCY_BUCKETS) | set(thresholds_s(dict(slos), slo))))


class Metrics:
    def __init__(self, slos: Mapping[str, SloConfig] | None = None, clock: Clock | None = None) -> None:
        """`slos`: model name -> its [slo] table (observability/slo_config.py model_slos)."""
        slos = slos or {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total etc.: the front end's own CPU and memory
        self.requests = Counter(
            "inferd_requests_total",
            "Logical requests by final outcome, and the protocol they came by (http, grpc).",
            ["model", "version", "outcome", "protocol"],
            registry=r,
        )
        self.rejected = Counter(
            "inferd_requests_rejected_total",
            "Requests refused before any work, by reason.",
            ["model", "version", "reason"],
            registry=r,
        )
        self.request_duration = Histogram(
            "inferd_request_duration_seconds",
            "Time from request arrival to response, by model, outcome and protocol (http, grpc).",
            ["model", "version", "outcome", "protocol"],
            buckets=latency_buckets(slos, "latency"),
            registry=r,
        )
        self.queue_wait = Histogram(
            "inferd_queue_wait_seconds",
            "Time items waited in the queue before their batch was cut.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute = Histogram(
            "inferd_batch_compute_seconds",
            "Device time of one batch, as the worker measured it.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "inferd_batch_size", "Items per batch.", ["model", "version"], buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_fill = Histogram(
            "inferd_batch_fill_ratio",
            "Batch size over max batch size.",
            ["model", "version"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.batches = Counter(
            "inferd_batch_executions_total",
            "Batches completed, by outcome.",
            ["model", "version", "outcome"],
            registry=r,
        )
        self.retried = Counter(
            "inferd_retried_items_total",
            "Items put back in their queue after a worker failure.",
            ["model", "version"],
            registry=r,
        )
        self.batch_failures = Counter(
            "inferd_batch_failures_total",
            "Batches lost to a worker failure, by cause (crash, hang).",
            ["model", "version", "cause"],
            registry=r,
        )
        self.isolation = Counter(
            "inferd_isolation_batches_total",
            "Batches run to isolate a failing input.",
            ["model", "version"],
            registry=r,
        )
        self.budget_exhausted = Counter(
            "inferd_retry_budget_exhausted_total",
            "Retries refused because the retry budget was spent.",
            ["model", "version"],
            registry=r,
        )
        self.cold_start = Histogram(
            "inferd_cold_start_seconds",
            "From the first request held with no worker in service to the first worker in service, by "
            "what brought it (scale_from_zero, pool_load).",
            ["model", "cause"],
            buckets=COLD_START_BUCKETS,
            registry=r,
        )
        self.worker_restarts = Counter(
            "inferd_worker_restarts_total", "Worker processes restarted.", ["model"], registry=r
        )
        self.ttft = Histogram(
            "inferd_time_to_first_token_seconds",
            "From an LLM request's arrival to its first token reaching the front end.",
            ["model", "version"],
            buckets=latency_buckets(slos, "ttft"),
            registry=r,
        )
        self.itl = Histogram(
            "inferd_inter_token_latency_seconds",
            "Between consecutive tokens of one stream, as the front end receives them.",
            ["model", "version"],
            buckets=latency_buckets(slos, "itl"),
            registry=r,
        )
        self.e2e = Histogram(
            "inferd_llm_request_duration_seconds",
            "From an LLM request's arrival to its last token.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "inferd_prompt_tokens_total", "Prompt tokens of LLM requests.", ["model", "version"], registry=r
        )
        self.generation_tokens = Counter(
            "inferd_generation_tokens_total",
            "Tokens generated for LLM requests.",
            ["model", "version"],
            registry=r,
        )
        self.cache = CacheMetrics(r)
        self.traffic = TrafficMetrics(r)
        self.shadow_requests = Counter(
            "inferd_shadow_requests_total",
            "Shadow copies of requests, by the version that ran them and how their answer compared with "
            "the primary's: same, different, error (failed or shed), dropped (over the shadow budget).",
            ["model", "version", "result"],
            registry=r,
        )
        self.fallback_requests = Counter(
            "inferd_fallback_requests_total",
            "Requests answered by a fallback model, by the model that could not take them, the model "
            "that answered, and why (unavailable, queue_full, deadline, breaker_open).",
            ["model", "fallback", "reason"],
            registry=r,
        )
        self.slo = SloMetrics(r, slos, clock or MonotonicClock())
        """SLI events and short-window burn rates of the models with an [slo] table."""
        self._requests: dict[tuple[str, int, str], RequestMetrics] = {}

    def requests_for(self, name: str, version: int, protocol: str = "http") -> RequestMetrics:
        """The request counters of one model version's calls by one protocol (bound once, then cached)."""
        key = (name, version, protocol)
        metrics = self._requests.get(key)
        if metrics is None:
            metrics = self._requests[key] = RequestMetrics(self, name, version, protocol)
        return metrics

    def request_statistics(self, name: str, version: int) -> RequestStatistics:
        """The requests of one model version answered so far, by every protocol."""
        found = [m.statistics() for (n, v, _), m in self._requests.items() if n == name and v == version]
        return RequestStatistics(
            ok=sum(s.ok for s in found),
            ok_s=sum(s.ok_s for s in found),
            failed=sum(s.failed for s in found),
            failed_s=sum(s.failed_s for s in found),
        )

    def for_model(self, name: str, version: int = 1) -> ModelMetrics:
        return ModelMetrics(self, name, version)

    def for_llm(self, name: str, version: int = 1) -> LLMMetrics:
        return LLMMetrics(self, name, version)

    def worker_restarted(self, model: str) -> None:
        self.worker_restarts.labels(model).inc()


OUTCOMES = (
    "ok",
    "bad_request",
    "unauthorized",
    "not_found",
    "too_large",
    "rate_limited",
    "rejected",
    "deadline",
    "unavailable",
    "worker_died",
    "model_error",
    "cancelled",
    "internal",
)


@dataclass(frozen=True, slots=True)
class RequestStatistics:
    """A model version's requests answered so far (gRPC's ModelStatistics): ok, and every other outcome."""

    ok: int = 0
    ok_s: float = 0.0
    """Their durations, summed."""
    failed: int = 0
    failed_s: float = 0.0


class RequestMetrics:
    """Logical requests of one model version by one protocol, whatever its kind and route: outcome
    counts, durations and refusals by reason (recorded by the API's accounting layer)."""

    def __init__(self, m: Metrics, model: str, version: int, protocol: str = "http") -> None:
        self.model = model
        self.version = str(version)
        self._m = m
        self._requests = {o: m.requests.labels(model, self.version, o, protocol) for o in OUTCOMES}
        self._duration = {o: m.request_duration.labels(model, self.version, o, protocol) for o in OUTCOMES}
        self._ok, self._ok_s, self._failed, self._failed_s = 0, 0.0, 0, 0.0

    def observe(self, outcome: str, duration_s: float) -> None:
        self._requests[outcome].inc()
        self._duration[outcome].observe(duration_s)
        if outcome == "ok":
            self._ok += 1
            self._ok_s += duration_s
        else:
            self._failed += 1
            self._failed_s += duration_s

    def statistics(self) -> RequestStatistics:
        return RequestStatistics(self._ok, self._ok_s, self._failed, self._failed_s)

    def rejected(self, reason: str) -> None:
        self._m.rejected.labels(self.model, self.version, reason).inc()


class ModelMetrics:
    """The batch metrics of one model version, with label children bound once."""

    def __init__(self, m: Metrics, model: str, version: int = 1) -> None:
        self.model = model
        self.version = str(version)
        self._m = m
        labels = (model, self.version)
        self._queue_wait = m.queue_wait.labels(*labels)
        self._compute = m.compute.labels(*labels)
        self._batch_size = m.batch_size.labels(*labels)
        self._batch_fill = m.batch_fill.labels(*labels)
        self._retried = m.retried.labels(*labels)

    def observe_batch_cut(self, size: int, max_size: int, waits: Iterable[float]) -> None:
        self._batch_size.observe(size)
        self._batch_fill.observe(size / max_size)
        for w in waits:
            self._queue_wait.observe(w)

    def observe_batch_done(self, compute_s: float, outcome: str) -> None:
        self._compute.observe(compute_s)
        self._m.batches.labels(self.model, self.version, outcome).inc()

    def retried_items(self, n: int) -> None:
        self._retried.inc(n)

    def batch_failed(self, cause: str) -> None:
        self._m.batch_failures.labels(self.model, self.version, cause).inc()

    def isolation_batches(self, n: int) -> None:
        self._m.isolation.labels(self.model, self.version).inc(n)

    def budget_exhausted(self) -> None:
        self._m.budget_exhausted.labels(self.model, self.version).inc()

    def cold_started(self, cause: str, seconds: float) -> None:
        self._m.cold_start.labels(self.model, cause).observe(seconds)


class LLMMetrics:
    """Token timing of one LLM model, with label children bound once."""

    def __init__(self, m: Metrics, model: str, version: int = 1) -> None:
        labels = (model, str(version))
        self._ttft = m.ttft.labels(*labels)
        self._itl = m.itl.labels(*labels)
        self._e2e = m.e2e.labels(*labels)
        self._prompt = m.prompt_tokens.labels(*labels)
        self._generated = m.generation_tokens.labels(*labels)
        self._slo = m.slo.for_model(model)
        self._m, self.model = m, model

    def submitted(self, prompt_tokens: int) -> None:
        self._prompt.inc(prompt_tokens)

    def generated(self, n: int) -> None:
        """`n` tokens streamed (one step's, every stream's together: one counter update per step)."""
        self._generated.inc(n)

    def tokens(self, n: int, since_previous_s: float, first: bool) -> None:
        """`n` tokens of one stream arrived `since_previous_s` after the previous ones (or after the
        request, if first): their timing (`generated` counts them)."""
        if first:
            self._ttft.observe(since_previous_s)
            if self._slo is not None:
                self._slo.first_token(since_previous_s)
        elif n:
            self._itl.observe(since_previous_s / n)
            if self._slo is not None:
                self._slo.tokens(n, since_previous_s / n)

    def finished(self, duration_s: float) -> None:
        self._e2e.observe(duration_s)

    def cold_started(self, cause: str, seconds: float) -> None:
        self._m.cold_start.labels(self.model, cause).observe(seconds)
