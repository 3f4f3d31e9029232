"""The search service's plain policies: hedging within its budget, the embedder breaker, replica choice,
the caches, request checks and the sequencer's group commit."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from inferd.clock import FakeClock
from inferd.errors import BadRequest, NotFound, PayloadTooLarge, ShuttingDown
from inferd.kinds.search.caches import LRU
from inferd.kinds.search.config import parse_params
from inferd.kinds.search.embedder import EmbedderHealth, EmbedderState
from inferd.kinds.search.hedge import HedgePolicy
from inferd.kinds.search.indexes import IndexAdmin, worker_cap
from inferd.kinds.search.replicas import (
    SLOW_SAMPLES,
    Replica,
    ReplicaChooser,
    ReplicaPhase,
    least_served_shard,
)
from inferd.kinds.search.requests import MAX_BATCH_DOCUMENTS, parse_documents, parse_search
from inferd.kinds.search.sequencer import ShardLog
from inferd.kinds.search.service import shard_of
from inferd.kinds.search.store import IndexStore
from inferd.kinds.search.types import Delete, Document, Upsert
from inferd.wire.connection import WorkerState

FIELDS = {"lang": "keyword", "year": "int"}


def test_hedges_never_exceed_five_percent_of_requests_plus_the_burst() -> None:
    policy = HedgePolicy(FakeClock(), shards=1, ratio=0.05, burst=2.0)
    granted = 0
    for _ in range(1000):
        policy.started()
        granted += policy.try_hedge()
    assert granted <= 0.05 * 1000 + 2
    assert granted >= 0.05 * 1000 - 2
    assert policy.statistics().denied == 1000 - granted


def test_hedge_delay_follows_the_shards_p95_once_it_has_samples() -> None:
    policy = HedgePolicy(FakeClock(), shards=2, min_samples=20, initial_delay_s=0.05)
    assert policy.delay_s(0) == 0.05
    for i in range(100):
        policy.observe(0, 0.001 * (i + 1))  # 1..100 ms
    assert policy.delay_s(0) == pytest.approx(0.095, abs=0.002)
    assert policy.delay_s(1) == 0.05  # the other shard still has no samples


def test_breaker_skips_the_embedder_while_down_and_probes_once_per_interval() -> None:
    clock = FakeClock()
    health = EmbedderHealth(clock, probe_interval_s=1.0)
    assert health.allow()
    health.failure("no ready worker")
    assert health.state is EmbedderState.DOWN
    assert not health.allow()
    clock.advance(1.0)
    assert health.allow()  # the probe
    assert not health.allow()  # only one per interval
    health.success()
    assert health.state is EmbedderState.UP and health.allow()


def replica(shard: int, seq: int, load: int = 0) -> Replica:
    conn = SimpleNamespace(worker_id=f"w{shard}-{seq}-{load}", state=WorkerState.READY)
    r = Replica(conn, shard, ReplicaPhase.SERVING, applied_seq=seq)  # type: ignore[arg-type]
    r.pending = {i: None for i in range(load)}  # type: ignore[misc]
    return r


def test_choice_prefers_fresh_replicas_then_the_lower_load() -> None:
    stale, fresh_busy, fresh_idle = replica(0, 3), replica(0, 9, load=5), replica(0, 9, load=0)
    chooser = ReplicaChooser(random.Random(1))
    picks = {chooser.choose([stale, fresh_busy, fresh_idle], 9, set()) for _ in range(50)}
    assert picks == {fresh_idle}
    assert chooser.choose([stale], 9, set()) is stale  # none fresh: the freshest answers
    assert chooser.choose([stale], 9, {stale}) is None


def test_a_slow_replica_gets_only_probes_until_answers_of_its_own_clear_it() -> None:
    fast, slow = replica(0, 9, load=3), replica(0, 9)
    fast.observe(0.002, now=0.0)
    for _ in range(SLOW_SAMPLES):  # idle, but 20x slower: 4 x 2 ms in flight still beats 1 x 40 ms
        slow.observe(0.040, now=0.0)
    chooser = ReplicaChooser(random.Random(1), probe_share=0.125)
    picks = []
    for step in range(100):  # 10 s: the old decay (e-fold a second) would have brought it back in 3
        now = step * 0.1
        fast.observe(0.002, now)
        picks.append(chooser.choose([fast, slow], 9, set(), now))
    assert slow.slow and picks.count(slow) == chooser.probes == 12  # probe_share of the first requests
    slow.pending = {7: None}  # type: ignore[dict-item]  # a probe in flight: no second one
    assert {chooser.choose([fast, slow], 9, set(), now) for _ in range(30)} == {fast}
    assert chooser.choose([fast, slow], 9, {fast}, now) is slow  # a failover may still use it
    slow.pending = {}
    wins = 0
    while slow.slow:  # probes that answer as fast as its peer bring its estimate down
        slow.observe(0.002, now)
        wins += 1
        chooser.choose([fast, slow], 9, set(), now)
    assert 3 <= wins <= 8
    assert chooser.choose([fast, slow], 9, set(), now) is slow  # and it takes its share again


def test_a_probe_is_hedged_at_once_and_may_take_the_last_hedge_token() -> None:
    policy = HedgePolicy(FakeClock(), shards=1, initial_delay_s=0.05, ratio=0.0)
    assert policy.delay_s(0, probe=True) == 0.0 and policy.delay_s(0, probe=False) == 0.05
    assert policy.try_hedge(probe=False)  # 2 tokens: an ordinary hedge leaves one for a probe
    assert not policy.try_hedge(probe=False)
    assert policy.try_hedge(probe=True)
    assert not policy.try_hedge(probe=True)


def test_a_slow_replica_holding_the_only_fresh_copy_is_no_probe_and_never_hedged_to_a_stale_one() -> None:
    stale, fresh = replica(0, 5), replica(0, 10)
    for _ in range(SLOW_SAMPLES):
        stale.observe(0.001, now=0.0)
        fresh.observe(0.040, now=0.0)
    fresh.slow = True  # judged slow against its peer
    chooser = ReplicaChooser(random.Random(1))
    policy = HedgePolicy(FakeClock(), shards=1, initial_delay_s=0.05)
    assert chooser.choose([stale, fresh], 10, set(), 0.0) is fresh  # the only one holding seq 10
    assert not chooser.probed and policy.delay_s(0, chooser.probed) == 0.05  # hedged on the p95, not at once
    assert chooser.choose([stale, fresh], 10, {fresh}, 0.0) is None  # no hedge, no failover to the stale one
    assert chooser.choose([stale, fresh], 5, {fresh}, 0.0) is stale  # where it holds the read's seq, it may
    assert chooser.choose([stale], 10, set(), 0.0) is stale  # none fresh at all: the freshest answers


def test_one_slow_sample_is_no_slow_verdict_and_a_replica_without_peers_is_not_slow() -> None:
    a, b = replica(0, 9), replica(0, 9)
    chooser = ReplicaChooser(random.Random(1))
    for _ in range(10):
        a.observe(0.001, now=0.0)
        b.observe(0.001, now=0.0)
    b.observe(0.0045, now=0.0)  # one call queued behind a burst
    chooser.choose([a, b], 9, set(), 0.0)
    assert not b.slow
    for _ in range(SLOW_SAMPLES):  # slow answers that persist are a slow replica
        b.observe(0.010, now=0.0)
    chooser.choose([a, b], 9, set(), 0.0)
    assert b.slow
    a.phase = ReplicaPhase.GONE  # its only peer went: nothing to compare with
    chooser.choose([a, b], 9, set(), 0.0)
    assert not b.slow


def test_a_slower_answer_counts_whole_and_an_unanswered_call_only_raises_the_estimate() -> None:
    r = replica(0, 0)
    r.observe(0.010, now=0.0)
    r.observe(0.030, now=0.0)
    assert r.latency_s == 0.030  # a peak is taken whole
    r.observe(0.005, now=0.0, lower_bound=True)  # given up after 5 ms: says nothing new
    assert r.latency_s == 0.030
    r.observe(0.050, now=0.0, lower_bound=True)
    assert r.latency_s == 0.050


def test_a_joining_replica_takes_the_shard_with_fewest_replicas() -> None:
    assert least_served_shard(3, [replica(0, 0), replica(0, 0), replica(2, 0)]) == 1


def test_lru_evicts_the_least_recently_used() -> None:
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b'{"query": "x", "k": 0}', '"k"'),
        (b'{"query": "x", "k": true}', '"k"'),
        (b'{"query": "  "}', '"query"'),
        (b'{"query": "x", "mode": "semantic"}', '"mode"'),
        (b'{"query": "x", "timeout_ms": 0}', "timeout_ms"),
        (b'{"query": "x", "min_seq": [1]}', "min_seq"),
        (b'{"query": "x", "filter": {"lang": {"in": "en"}}}', "lang"),
        (b'{"query": "x", "top": 3}', "top"),
        (b'{"query": "x", "cache": 0}', '"cache"'),
        (b"[1]", "JSON object"),
        (b"{", "not valid JSON"),
    ],
)
def test_bad_searches_name_the_problem(body: bytes, named: str) -> None:
    with pytest.raises(BadRequest, match=named):
        parse_search(body, FIELDS, shards=2)


def test_x_request_timeout_ms_bounds_a_search_and_the_smaller_of_two_wins() -> None:
    def timeout(body: bytes, header_ms: float | None) -> float:
        return parse_search(body, FIELDS, shards=2, header_timeout_ms=header_ms).timeout_ms

    assert timeout(b'{"query": "x"}', None) == 1000.0  # the default
    assert timeout(b'{"query": "x"}', 5000.0) == 5000.0  # the header alone replaces the default
    assert timeout(b'{"query": "x", "timeout_ms": 300}', 5000.0) == 300.0
    assert timeout(b'{"query": "x", "timeout_ms": 3000}', 200.0) == 200.0
    with pytest.raises(BadRequest, match="X-Request-Timeout-Ms"):
        timeout(b'{"query": "x"}', 0.0)
    with pytest.raises(BadRequest, match="X-Request-Timeout-Ms"):
        timeout(b'{"query": "x"}', 120_000.0)


def test_a_search_may_skip_the_result_cache() -> None:
    assert parse_search(b'{"query": "x"}', FIELDS, shards=2).cache is True
    assert parse_search(b'{"query": "x", "cache": false}', FIELDS, shards=2).cache is False


def test_documents_are_checked_whole() -> None:
    ok = parse_documents(b'{"documents": [{"id": "a", "text": "t", "fields": {"year": 3}}]}', FIELDS)
    assert ok == [Document(id="a", text="t", fields={"year": 3})]
    with pytest.raises(BadRequest, match="same id 'a'"):
        parse_documents(b'{"documents": [{"id": "a", "text": "t"}, {"id": "a", "text": "u"}]}', FIELDS)
    with pytest.raises(BadRequest, match="field 'year' is int"):
        parse_documents(b'{"documents": [{"id": "a", "text": "t", "fields": {"year": true}}]}', FIELDS)
    with pytest.raises(BadRequest, match="does not declare"):
        parse_documents(b'{"documents": [{"id": "a", "text": "t", "fields": {"x": 1}}]}', FIELDS)
    many = b'{"documents": [' + b",".join([b'{"id": "a", "text": "t"}'] * (MAX_BATCH_DOCUMENTS + 1)) + b"]}"
    with pytest.raises(PayloadTooLarge):
        parse_documents(many, FIELDS)


def test_documents_spread_over_every_shard_stably() -> None:
    shards = [shard_of(f"doc-{i}", 4) for i in range(400)]
    assert set(shards) == {0, 1, 2, 3}
    assert shards == [shard_of(f"doc-{i}", 4) for i in range(400)]


async def test_concurrent_writers_share_group_commits_and_get_consecutive_seqs(tmp_path: Path) -> None:
    log = ShardLog(0, tmp_path / "shard-0" / "wal")
    ops = [[Upsert(doc=Document(id=f"d{i}", text="t"))] for i in range(20)]
    seqs = await asyncio.gather(*(log.append(o) for o in ops))
    assert sorted(seqs) == list(range(1, 21))
    assert log.writes < 20  # writers waiting behind a write went into the next one
    assert [e.seq for e in log.entries_after(0, 100)] == list(range(1, 21))
    await log.snapshotted(15, keep_after=17)
    assert [e.seq for e in log.entries_after(17, 100)] == [18, 19, 20]
    assert log.entries_after(10, 100) is None  # behind the tail: reload the snapshot
    log.close(ShuttingDown("stopping"))
    reopened = ShardLog(0, tmp_path / "shard-0" / "wal")
    assert reopened.durable_seq == 20 and reopened.first_seq == 16
    assert await reopened.append([Delete(id="d1")]) == 21
    reopened.close(ShuttingDown("stopping"))


async def test_a_write_racing_its_logs_close_gets_the_closing_reason_never_a_500(tmp_path: Path) -> None:
    # An outside fuzzer found it: a write sent while its index was deleted answered 500 (the log's
    # executor was shut down: "cannot schedule new futures after shutdown").
    log = ShardLog(0, tmp_path / "shard-0" / "wal")
    first = asyncio.ensure_future(log.append([Upsert(doc=Document(id="a", text="t"))]))
    await asyncio.sleep(0)  # it holds the lock, its write running
    waiting = asyncio.ensure_future(log.append([Upsert(doc=Document(id="b", text="t"))]))  # behind it
    await asyncio.sleep(0)
    gone = NotFound("index 'x' was deleted")
    log.close(gone)
    assert await first == 1  # the write already running finishes, and is acknowledged
    with pytest.raises(NotFound, match="was deleted"):
        await waiting  # queued behind it: refused, nothing written
    with pytest.raises(NotFound, match="was deleted"):
        await log.append([Delete(id="a")])  # arriving later
    await log.snapshotted(1, keep_after=1)  # a snapshot finishing after the close: nothing to do
    reopened = ShardLog(0, tmp_path / "shard-0" / "wal")
    assert reopened.durable_seq == 1
    reopened.close(ShuttingDown("stopping"))


class _NoServer:
    """A composition root that fails the test if an index is started."""

    registry = None
    supervisor = None

    def add_version(self, config: object) -> None:
        raise AssertionError("a refused index must start nothing")


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"shards": 65}, "shards"),
        ({"replicas": 9}, "replicas"),
        ({"shards": 1000, "replicas": 1000}, "shards"),
    ],
)
def test_index_settings_cap_shards_and_replicas(settings: dict, named: str) -> None:
    with pytest.raises(BadRequest, match=named):
        parse_params(settings, "settings of index 'big'")


async def test_an_index_over_the_machines_process_cap_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    assert worker_cap(2) == 16 and worker_cap(64) == 256 and worker_cap(None) == 16
    admin = IndexAdmin(_NoServer(), IndexStore(tmp_path), max_workers=worker_cap(2))  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match=r"64 shards x 8 replicas = 512 worker processes.*at most 16"):
        await admin.create("big", parse_params({"shards": 64, "replicas": 8}, "settings"))
    assert not os.listdir(tmp_path)  # nothing saved either
