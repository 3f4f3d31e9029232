"""RuntimeCollector asks each registered kind for its own families (`Kind.metric_families`): the built-in
kinds' output is what their functions give on the same snapshots, and a kind of a component's own
exports the family it declares."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from inferd.kinds.batch.metrics import batch_families
from inferd.kinds.builtin import builtin_kinds
from inferd.kinds.collectors import RuntimeCollector, worker_families
from inferd.kinds.llm.metrics import llm_families
from inferd.kinds.upstream.metrics import upstream_families
from inferd.runtime.contract import RuntimeStatistics, WorkerSnapshot
from inferd.runtime.kinds import Kind, KindRegistry
from inferd.runtime.registry import ModelRegistry


class _Runtime:
    def __init__(self, snapshot: RuntimeStatistics) -> None:
        self._snapshot = snapshot

    def statistics(self) -> RuntimeStatistics:
        return self._snapshot


def _worker(model: str, worker_id: str, state: str) -> WorkerSnapshot:
    return WorkerSnapshot(worker_id, model, 1, state, 10, "local", 7, 2, 1.5, 0.0, 0.0)


def _batch() -> RuntimeStatistics:
    detail = SimpleNamespace(
        queued_items=3, queue_capacity=64, busy_ratio=0.25, queued_interactive=2, queued_bulk=1
    )
    workers = (_worker("m", "m-1-w0", "ready"), _worker("m", "m-1-w1", "draining"))
    return RuntimeStatistics("m", 1, "batch", True, workers, 1, 3, 4, detail)


def _llm() -> RuntimeStatistics:
    detail = SimpleNamespace(
        running=2, waiting=1, streams=3, kv_blocks_used=5, kv_blocks_total=20, finished=9, aborted=1,
        errored=0, client_aborts=1, steps=40, preemptions=2, prefix_hit_tokens=11, prefix_query_tokens=30,
    )
    return RuntimeStatistics("chat", 1, "llm", True, (_worker("chat", "chat-1-w0", "ready"),), 1, 1, 2, detail)


def _upstream() -> RuntimeStatistics:
    up = SimpleNamespace(upstream="http://a", health=2, inflight=1, successes=5, failures=1, ignorable=0)
    detail = SimpleNamespace(
        upstreams=(up,), ejections=1, retries=2, refused_full=0, refused_unavailable=1, equal_loads=3,
        choices=6,
    )
    return RuntimeStatistics("remote", 1, "upstream", True, (), 0, 0, 1, detail)


def _search() -> RuntimeStatistics:
    return RuntimeStatistics("docs", 1, "search", True, (_worker("docs", "docs-1-w0", "ready"),), 1, 0, 0)


class _Fixed(Collector):
    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families

    def describe(self) -> list[Any]:
        return []


def _exposition(families: list[Any]) -> bytes:
    """The /metrics text of these families."""
    registry = CollectorRegistry()
    registry.register(_Fixed(families))
    return generate_latest(registry)


def _collector(kinds: KindRegistry, snapshots: list[RuntimeStatistics]) -> RuntimeCollector:
    return RuntimeCollector(cast(ModelRegistry, [_Runtime(s) for s in snapshots]), kinds)


def test_the_built_in_kinds_export_what_their_functions_give_on_the_same_snapshots() -> None:
    snapshots = [_batch(), _llm(), _upstream(), _search()]
    by = {s.kind: [s] for s in snapshots}
    expected = [
        *worker_families(snapshots, frozenset({"batch", "llm"})),
        *batch_families(by["batch"]),
        *llm_families(by["llm"]),
        *upstream_families(by["upstream"]),
    ]
    got = _collector(builtin_kinds(), snapshots).collect()
    assert [f.name for f in got] == [f.name for f in expected]
    assert _exposition(got) == _exposition(expected)
    text = _exposition(got).decode()
    assert 'inferd_workers{model="m",state="draining",version="1"} 1.0' in text
    assert 'inferd_workers{model="chat",state="ready",version="1"} 1.0' in text
    assert 'inferd_workers{model="docs"' not in text  # search's replicas are not counted there
    assert 'inferd_queue_depth{model="m",version="1"} 3.0' in text
    assert 'inferd_upstream_health{model="remote",upstream="http://a",version="1"} 2.0' in text


def test_a_kind_serving_no_model_exports_its_families_empty() -> None:
    got = _collector(builtin_kinds(), [_batch()]).collect()
    expected = [
        *worker_families([_batch()], frozenset({"batch", "llm"})),
        *batch_families([_batch()]),
        *llm_families([]),
        *upstream_families([]),
    ]
    assert _exposition(got) == _exposition(expected)


def test_a_kind_of_its_own_exports_the_family_it_declares() -> None:
    def families(snapshots: list[RuntimeStatistics]) -> list[Any]:
        g = GaugeMetricFamily("inferd_custom_things", "Things of the custom kind.", labels=["model"])
        for s in snapshots:
            g.add_metric([s.name], s.queued)
        return [g]

    def make(*_: Any) -> Any:
        raise AssertionError("not built here")

    kinds = KindRegistry([Kind("custom", make, metric_families=families, counts_workers=True), Kind("plain", make)])
    custom = RuntimeStatistics("c", 2, "custom", True, (_worker("c", "c-2-w0", "ready"),), 1, 5, 0)
    plain = RuntimeStatistics("p", 1, "plain", True, (_worker("p", "p-1-w0", "ready"),), 1, 0, 0)
    got = _collector(kinds, [custom, plain]).collect()
    names = [f.name for f in got]
    assert names == [
        "inferd_workers", "inferd_model_ready", "inferd_worker_load", "inferd_worker_busy_seconds",
        "inferd_worker_batches", "inferd_custom_things",
    ]
    text = _exposition(got).decode()
    assert 'inferd_custom_things{model="c"} 5.0' in text
    assert 'inferd_workers{model="c",state="ready",version="2"} 1.0' in text
    assert 'inferd_workers{model="p"' not in text  # "plain" does not count its workers
    assert 'inferd_model_ready{model="p",version="1"} 1.0' in text
