"""Prometheus metrics. Names: inferd_<component>_<thing>_<unit>, base units, bounded labels.

Per-request paths use pre-bound label children (one dict lookup, one lock) so metrics stay cheap at
thousands of requests per second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from inferd.batching.dispatcher import ModelRuntime

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
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "inferd_requests_total", "Logical requests by final outcome.", ["model", "outcome"], registry=r
        )
        self.rejected = Counter(
            "inferd_requests_rejected_total",
            "Requests refused before any work, by reason.",
            ["model", "reason"],
            registry=r,
        )
        self.request_duration = Histogram(
            "inferd_request_duration_seconds",
            "Time from request arrival to response, by model and outcome.",
            ["model", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "inferd_queue_wait_seconds",
            "Time items waited in the queue before their batch was cut.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute = Histogram(
            "inferd_batch_compute_seconds",
            "Device time of one batch, as the worker measured it.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "inferd_batch_size", "Items per batch.", ["model"], buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_fill = Histogram(
            "inferd_batch_fill_ratio",
            "Batch size over max batch size.",
            ["model"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.batches = Counter(
            "inferd_batch_executions_total",
            "Batches completed, by outcome.",
            ["model", "outcome"],
            registry=r,
        )
        self.retried = Counter(
            "inferd_retried_items_total",
            "Items put back in their queue after a worker failure.",
            ["model"],
            registry=r,
        )
        self.batch_failures = Counter(
            "inferd_batch_failures_total",
            "Batches lost to a worker failure, by cause (crash, hang).",
            ["model", "cause"],
            registry=r,
        )
        self.isolation = Counter(
            "inferd_isolation_batches_total", "Batches run to isolate a failing input.", ["model"], registry=r
        )
        self.budget_exhausted = Counter(
            "inferd_retry_budget_exhausted_total",
            "Retries refused because the retry budget was spent.",
            ["model"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "inferd_worker_restarts_total", "Worker processes restarted.", ["model"], registry=r
        )
        self.ttft = Histogram(
            "inferd_time_to_first_token_seconds",
            "From an LLM request's arrival to its first token reaching the front end.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "inferd_inter_token_latency_seconds",
            "Between consecutive tokens of one stream, as the front end receives them.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "inferd_llm_request_duration_seconds",
            "From an LLM request's arrival to its last token.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "inferd_prompt_tokens_total", "Prompt tokens of LLM requests.", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            "inferd_generation_tokens_total", "Tokens generated for LLM requests.", ["model"], registry=r
        )
        self._runtimes: dict[str, ModelRuntime] = {}
        r.register(_RuntimeCollector(lambda: self._runtimes.values()))

    def for_model(self, name: str) -> ModelMetrics:
        return ModelMetrics(self, name)

    def for_llm(self, name: str) -> LLMMetrics:
        return LLMMetrics(self, name)

    def track(self, runtime: ModelRuntime) -> None:
        self._runtimes[runtime.name] = runtime


class ModelMetrics:
    """The metrics of one model, with label children bound once."""

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

    def __init__(self, m: Metrics, model: str) -> None:
        self.model = model
        self._m = m
        self._requests = {o: m.requests.labels(model, o) for o in self.OUTCOMES}
        self._duration = {o: m.request_duration.labels(model, o) for o in self.OUTCOMES}
        self._queue_wait = m.queue_wait.labels(model)
        self._compute = m.compute.labels(model)
        self._batch_size = m.batch_size.labels(model)
        self._batch_fill = m.batch_fill.labels(model)
        self._retried = m.retried.labels(model)

    def observe_request(self, outcome: str, duration_s: float) -> None:
        self._requests[outcome].inc()
        self._duration[outcome].observe(duration_s)

    def rejected(self, reason: str) -> None:
        self._m.rejected.labels(self.model, reason).inc()

    def observe_batch_cut(self, size: int, max_size: int, waits: Iterable[float]) -> None:
        self._batch_size.observe(size)
        self._batch_fill.observe(size / max_size)
        for w in waits:
            self._queue_wait.observe(w)

    def observe_batch_done(self, compute_s: float, outcome: str) -> None:
        self._compute.observe(compute_s)
        self._m.batches.labels(self.model, outcome).inc()

    def retried_items(self, n: int) -> None:
        self._retried.inc(n)

    def batch_failed(self, cause: str) -> None:
        self._m.batch_failures.labels(self.model, cause).inc()

    def isolation_batches(self, n: int) -> None:
        self._m.isolation.labels(self.model).inc(n)

    def budget_exhausted(self) -> None:
        self._m.budget_exhausted.labels(self.model).inc()

    def worker_restarted(self) -> None:
        self._m.worker_restarts.labels(self.model).inc()


class LLMMetrics:
    """Token timing of one LLM model, with label children bound once."""

    def __init__(self, m: Metrics, model: str) -> None:
        self._ttft = m.ttft.labels(model)
        self._itl = m.itl.labels(model)
        self._e2e = m.e2e.labels(model)
        self._prompt = m.prompt_tokens.labels(model)
        self._generated = m.generation_tokens.labels(model)

    def submitted(self, prompt_tokens: int) -> None:
        self._prompt.inc(prompt_tokens)

    def tokens(self, n: int, since_previous_s: float, first: bool) -> None:
        """`n` tokens arrived `since_previous_s` after the previous ones (or after the request, if first)."""
        self._generated.inc(n)
        if first:
            self._ttft.observe(since_previous_s)
        elif n:
            self._itl.observe(since_previous_s / n)

    def finished(self, duration_s: float) -> None:
        self._e2e.observe(duration_s)


class _RuntimeCollector(Collector):
    """Gauges read from the live runtimes at scrape time (queue depth, busy ratio, workers)."""

    def __init__(self, runtimes: Callable[[], Iterable[ModelRuntime]]) -> None:
        self._runtimes = runtimes

    def describe(self):
        return []

    def collect(self):
        depth = GaugeMetricFamily(
            "inferd_queue_depth", "Items waiting in the model's queue.", labels=["model"]
        )
        bound = GaugeMetricFamily("inferd_queue_capacity", "Queue bound in items.", labels=["model"])
        busy = GaugeMetricFamily(
            "inferd_device_busy_ratio",
            "Share of the last 10 s the model's devices spent computing.",
            labels=["model"],
        )
        workers = GaugeMetricFamily(
            "inferd_workers", "Worker connections by state.", labels=["model", "state"]
        )
        inflight = GaugeMetricFamily(
            "inferd_inflight_batches", "Batches sent to workers and not yet answered.", labels=["model"]
        )
        per_worker = GaugeMetricFamily(
            "inferd_worker_inflight_batches",
            "Batches in flight per worker (worker = its slot, so the label set is bounded by the fleet).",
            labels=["model", "worker"],
        )
        worker_busy = CounterMetricFamily(
            "inferd_worker_busy_seconds", "Device seconds per worker connection.", labels=["model", "worker"]
        )
        worker_batches = CounterMetricFamily(
            "inferd_worker_batches", "Batches completed per worker connection.", labels=["model", "worker"]
        )
        queued_by_priority = GaugeMetricFamily(
            "inferd_queue_depth_by_priority", "Queued items by priority class.", labels=["model", "priority"]
        )
        for rt in self._runtimes():
            for w in rt.workers:
                slot = w.slot_id
                per_worker.add_metric([rt.name, slot], len(w.inflight))
                worker_busy.add_metric([rt.name, slot], w.busy_s)
                worker_batches.add_metric([rt.name, slot], w.completed_batches)
            queued_by_priority.add_metric([rt.name, "interactive"], rt.queue.live_in(0))
            queued_by_priority.add_metric([rt.name, "bulk"], rt.queue.live_in(1))
            depth.add_metric([rt.name], len(rt.queue))
            bound.add_metric([rt.name], rt.queue.max_size)
            busy.add_metric([rt.name], rt.busy_ratio())
            inflight.add_metric([rt.name], sum(len(w.inflight) for w in rt.workers))
            counts: dict[str, int] = {}
            for w in rt.workers:
                counts[w.state.value] = counts.get(w.state.value, 0) + 1
            for state in ("ready", "draining"):
                workers.add_metric([rt.name, state], counts.get(state, 0))
        return [
            depth,
            bound,
            busy,
            workers,
            inflight,
            per_worker,
            worker_busy,
            worker_batches,
            queued_by_priority,
        ]
