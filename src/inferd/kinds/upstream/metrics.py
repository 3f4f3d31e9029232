"""Metrics of models served by upstream engines (openai-upstream).

Token timing goes into the same series as local LLM models (inferd_time_to_first_token_seconds,
inferd_inter_token_latency_seconds, inferd_llm_request_duration_seconds, inferd_prompt_tokens_total,
inferd_generation_tokens_total), so one dashboard covers both. Upstream health, requests in flight,
attempts by outcome, ejections and retries are read from each runtime's statistics() at scrape time;
the `upstream` label is a configured URL, so the label set is bounded by the config.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inferd.observability.metrics import LLMMetrics
from inferd.runtime.contract import RuntimeStatistics


class UpstreamMetrics(LLMMetrics):
    """Token timing of one upstream-served model, in the same series as local LLM models. The front end
    sees SSE events, not tokens: each event with text counts as one token step for the inter-token
    latency, and token counts come from the upstream's usage (asked for on every stream)."""

    def text_event(self, since_previous_s: float, first: bool) -> None:
        """An event carrying text arrived `since_previous_s` after the previous one (or the request)."""
        (self._ttft if first else self._itl).observe(since_previous_s)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self._prompt.inc(prompt_tokens)
        self._generated.inc(completion_tokens)


def upstream_families(snapshots: Iterable[RuntimeStatistics]) -> list[Any]:
    """The pool gauges and counters of the upstream-kind snapshots (detail: the pool's statistics)."""
    health = GaugeMetricFamily(
        "inferd_upstream_health",
        "Health of each upstream engine: 2 up, 1 probing, 0 ejected.",
        labels=["model", "version", "upstream"],
    )
    inflight = GaugeMetricFamily(
        "inferd_upstream_inflight_requests",
        "Requests in flight to each upstream engine.",
        labels=["model", "version", "upstream"],
    )
    attempts = CounterMetricFamily(
        "inferd_upstream_attempts",
        "Requests sent to each upstream (attempts, retries included), by outcome.",
        labels=["model", "version", "upstream", "outcome"],
    )
    ejections = CounterMetricFamily(
        "inferd_upstream_ejections", "Upstreams ejected after failures.", labels=["model", "version"]
    )
    retries = CounterMetricFamily(
        "inferd_upstream_retries",
        "Requests tried again on another upstream after a failure before any byte was streamed.",
        labels=["model", "version"],
    )
    refused = CounterMetricFamily(
        "inferd_upstream_refused",
        "Requests refused before sending: every healthy upstream full (429) or none healthy (503).",
        labels=["model", "version", "reason"],
    )
    ties = CounterMetricFamily(
        "inferd_upstream_equal_loads",
        "Choices where the least-loaded upstream tied with another (near all choices: the in-flight "
        "count is not telling upstreams apart).",
        labels=["model", "version"],
    )
    choices = CounterMetricFamily("inferd_upstream_choices", "Upstreams chosen.", labels=["model", "version"])
    for snap in snapshots:
        s = snap.detail
        key = [snap.name, str(snap.version)]
        for u in s.upstreams:
            health.add_metric([*key, u.upstream], int(u.health))
            inflight.add_metric([*key, u.upstream], u.inflight)
            attempts.add_metric([*key, u.upstream, "success"], u.successes)
            attempts.add_metric([*key, u.upstream, "failure"], u.failures)
            attempts.add_metric([*key, u.upstream, "ignorable"], u.ignorable)
        ejections.add_metric([*key], s.ejections)
        retries.add_metric(key, s.retries)
        refused.add_metric([*key, "full"], s.refused_full)
        refused.add_metric([*key, "unavailable"], s.refused_unavailable)
        ties.add_metric([*key], s.equal_loads)
        choices.add_metric([*key], s.choices)
    return [health, inflight, attempts, ejections, retries, refused, ties, choices]
