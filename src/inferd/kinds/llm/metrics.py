"""Prometheus gauges and counters of the LLM runtimes, read at scrape time from each runtime's
statistics() (the scheduler statistics its workers report with every step)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inferd.runtime.contract import RuntimeStatistics


def llm_families(snapshots: Iterable[RuntimeStatistics]) -> list[Any]:
    """The LLM gauges and counters of the llm-kind snapshots (detail: LLMRuntimeStatistics)."""
    seqs = GaugeMetricFamily(
        "inferd_llm_sequences",
        "Live sequences in the engines, by state.",
        labels=["model", "version", "state"],
    )
    streams = GaugeMetricFamily(
        "inferd_llm_streams", "Token streams open on the front end.", labels=["model", "version"]
    )
    kv = GaugeMetricFamily(
        "inferd_llm_kv_usage_ratio", "Share of the engines' KV blocks in use.", labels=["model", "version"]
    )
    ended = CounterMetricFamily(
        "inferd_llm_sequences_ended",
        "Sequences the engines ended, by outcome.",
        labels=["model", "version", "outcome"],
    )
    aborts = CounterMetricFamily(
        "inferd_llm_client_aborts",
        "Sequences aborted because the client went away.",
        labels=["model", "version"],
    )
    steps = CounterMetricFamily("inferd_llm_steps", "Engine steps run.", labels=["model", "version"])
    preemptions = CounterMetricFamily(
        "inferd_llm_preemptions", "Sequences preempted for KV blocks or seats.", labels=["model", "version"]
    )
    prefix_hits = CounterMetricFamily(
        "inferd_llm_prefix_cache_hit_tokens",
        "Prompt tokens found in the engines' prefix caches at admission (hit ratio: rate of this over "
        "the rate of inferd_llm_prefix_cache_query_tokens_total).",
        labels=["model", "version"],
    )
    prefix_queries = CounterMetricFamily(
        "inferd_llm_prefix_cache_query_tokens",
        "Prompt tokens looked up in the engines' prefix caches at admission.",
        labels=["model", "version"],
    )
    for snap in snapshots:
        s = snap.detail
        key = [snap.name, str(snap.version)]
        seqs.add_metric([*key, "running"], s.running)
        seqs.add_metric([*key, "waiting"], s.waiting)
        streams.add_metric([*key], s.streams)
        kv.add_metric([*key], s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        for outcome in ("finished", "aborted", "errored"):
            ended.add_metric([*key, outcome], getattr(s, outcome))
        aborts.add_metric([*key], s.client_aborts)
        steps.add_metric([*key], s.steps)
        preemptions.add_metric([*key], s.preemptions)
        prefix_hits.add_metric([*key], s.prefix_hit_tokens)
        prefix_queries.add_metric([*key], s.prefix_query_tokens)
    return [seqs, streams, kv, ended, aborts, steps, preemptions, prefix_hits, prefix_queries]
