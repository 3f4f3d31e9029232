"""Prometheus gauges and counters of the LLM runtimes, read at scrape time from each runtime's
statistics() (the scheduler statistics its workers report with every step)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from inferd.llm.runtime import LLMRuntime


class LLMCollector(Collector):
    def __init__(self, runtimes: Callable[[], Iterable[LLMRuntime]]) -> None:
        self._runtimes = runtimes

    def describe(self):
        return []

    def collect(self):
        seqs = GaugeMetricFamily(
            "inferd_llm_sequences", "Live sequences in the engines, by state.", labels=["model", "state"]
        )
        streams = GaugeMetricFamily(
            "inferd_llm_streams", "Token streams open on the front end.", labels=["model"]
        )
        kv = GaugeMetricFamily(
            "inferd_llm_kv_usage_ratio", "Share of the engines' KV blocks in use.", labels=["model"]
        )
        ended = CounterMetricFamily(
            "inferd_llm_sequences_ended",
            "Sequences the engines ended, by outcome.",
            labels=["model", "outcome"],
        )
        aborts = CounterMetricFamily(
            "inferd_llm_client_aborts", "Sequences aborted because the client went away.", labels=["model"]
        )
        steps = CounterMetricFamily("inferd_llm_steps", "Engine steps run.", labels=["model"])
        preemptions = CounterMetricFamily(
            "inferd_llm_preemptions", "Sequences preempted for KV blocks or seats.", labels=["model"]
        )
        prefix_hits = CounterMetricFamily(
            "inferd_llm_prefix_cache_hit_tokens",
            "Prompt tokens found in the engines' prefix caches at admission (hit ratio: rate of this over "
            "the rate of inferd_llm_prefix_cache_query_tokens_total).",
            labels=["model"],
        )
        prefix_queries = CounterMetricFamily(
            "inferd_llm_prefix_cache_query_tokens",
            "Prompt tokens looked up in the engines' prefix caches at admission.",
            labels=["model"],
        )
        for rt in self._runtimes():
            s = rt.statistics().detail
            seqs.add_metric([rt.name, "running"], s.running)
            seqs.add_metric([rt.name, "waiting"], s.waiting)
            streams.add_metric([rt.name], s.streams)
            kv.add_metric([rt.name], s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
            for outcome in ("finished", "aborted", "errored"):
                ended.add_metric([rt.name, outcome], getattr(s, outcome))
            aborts.add_metric([rt.name], s.client_aborts)
            steps.add_metric([rt.name], s.steps)
            preemptions.add_metric([rt.name], s.preemptions)
            prefix_hits.add_metric([rt.name], s.prefix_hit_tokens)
            prefix_queries.add_metric([rt.name], s.prefix_query_tokens)
        return [seqs, streams, kv, ended, aborts, steps, preemptions, prefix_hits, prefix_queries]
