"""ShardIndex: seq order and idempotent replay, filters on both lists, snapshots and restart by replay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inferd.kinds.search import snapshot
from inferd.kinds.search.filters import parse_filter
from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.types import (
    CorruptSnapshot,
    Delete,
    Document,
    IndexSettings,
    LogEntry,
    SeqGap,
    ShardQuery,
    Upsert,
)
from inferd.kinds.search.wal import WriteAheadLog

SETTINGS = IndexSettings(dim=16, fields={"lang": "keyword", "year": "int", "score": "float", "open": "bool"})


def vector(seed: int) -> bytes:
    v = np.random.default_rng(seed).normal(size=16).astype("<f4")
    return (v / np.linalg.norm(v)).tobytes()


def doc(i: int) -> Upsert:
    fields = {"lang": ["en", "fr", "de"][i % 3], "year": 2000 + i % 5, "score": i / 10, "open": i % 2 == 0}
    return Upsert(
        doc=Document(id=f"d{i}", title=f"title {i}", text=f"common word{i % 7} n{i}", fields=fields),
        vector=vector(i),
    )


def entries(n: int, per: int = 10) -> list[LogEntry]:
    return [LogEntry(seq=s + 1, ops=[doc(i) for i in range(s * per, (s + 1) * per)]) for s in range(n)]


def query(**kw) -> ShardQuery:
    return ShardQuery(**{"text": "common word3", "vector": vector(3), "k": 10, "mode": "hybrid", **kw})


def test_replaying_entries_changes_nothing_and_never_duplicates():
    once, twice = ShardIndex(SETTINGS), ShardIndex(SETTINGS)
    log = [*entries(5), LogEntry(seq=6, ops=[doc(3), Delete(id="d4"), doc(3)])]
    for e in log:
        once.apply(e)
    for e in log + log:
        twice.apply(e)
    assert once.documents == twice.documents == 49
    assert once.search(query(k=100)) == twice.search(query(k=100))
    ids = [h.id for h in twice.search(query(k=100)).dense]
    assert len(ids) == len(set(ids)) == 49


def test_a_gap_in_seq_raises_and_applies_nothing():
    shard = ShardIndex(SETTINGS)
    shard.apply(entries(1)[0])
    with pytest.raises(SeqGap):
        shard.apply(LogEntry(seq=3, ops=[doc(99)]))
    assert shard.applied_seq == 1 and shard.get("d99") is None


def test_a_document_is_searchable_as_soon_as_its_entry_is_applied():
    shard = ShardIndex(SETTINGS)
    for e in entries(3):
        shard.apply(e)
    shard.apply(LogEntry(seq=4, ops=[Upsert(doc=Document(id="new", text="zebra"), vector=vector(1000))]))
    result = shard.search(ShardQuery(text="zebra", vector=vector(1000), k=1, mode="hybrid"))
    assert [h.id for h in result.lexical] == ["new"] and [h.id for h in result.dense] == ["new"]
    shard.apply(LogEntry(seq=5, ops=[Delete(id="new")]))
    result = shard.search(ShardQuery(text="zebra", vector=vector(1000), k=30, mode="hybrid"))
    assert result.lexical == [] and "new" not in {h.id for h in result.dense}


@pytest.mark.parametrize(
    "raw",
    [
        {"lang": "fr"},
        {"year": {"in": [2001, 2003]}},
        {"lang": {"in": ["en", "de"]}, "open": True},
        {"score": 0.5},
    ],
)
def test_filters_apply_to_both_lists_and_k_matches_come_back(raw):
    shard = ShardIndex(SETTINGS, dense_fresh_limit=16)
    for e in entries(30):  # 300 docs, most of them in the HNSW graph
        shard.apply(e)
    flt = parse_filter(raw, SETTINGS.fields)
    matching = [
        f"d{i}" for i in range(300) if all(_matches(shard.get(f"d{i}").fields[f], v) for f, v in raw.items())
    ]
    k = min(10, len(matching))
    result = shard.search(query(filter=flt, text="common"))
    assert len(result.lexical) == k and len(result.dense) == k
    assert {h.id for h in result.lexical + result.dense} <= set(matching)


def _matches(value, cond) -> bool:
    return value in cond["in"] if isinstance(cond, dict) else value == cond


def test_a_selective_filter_over_the_graph_still_returns_k(tmp_path: Path):
    shard = ShardIndex(SETTINGS, dense_fresh_limit=8)
    for e in entries(40):
        shard.apply(e)
    shard.apply(LogEntry(seq=41, ops=[Delete(id=f"d{i}") for i in range(0, 400, 2)]))
    result = shard.search(query(filter=parse_filter({"open": False}, SETTINGS.fields), k=50, mode="dense"))
    assert len(result.dense) == 50  # 200 live docs, all odd, all open=False


def test_restart_is_snapshot_plus_replay_of_the_log(tmp_path: Path):
    log = WriteAheadLog(tmp_path / "shard.wal")
    shard = ShardIndex(SETTINGS, dense_fresh_limit=8, compact_min_dead=5)
    for e in entries(6):
        log.append([e])
        shard.apply(e)
    shard.save(tmp_path / "snap")
    later = [LogEntry(seq=7, ops=[Delete(id="d1"), doc(77)]), LogEntry(seq=8, ops=[doc(5)])]
    for e in later:
        log.append([e])
        shard.apply(e)
    log.close()

    log = WriteAheadLog(tmp_path / "shard.wal")
    restored = ShardIndex.load(tmp_path / "snap", SETTINGS)
    assert restored.applied_seq == 6
    for e in log.read_from(1):  # replaying from the start is safe too: covered entries are ignored
        restored.apply(e)
    assert restored.applied_seq == 8 and restored.documents == shard.documents
    for q in (query(k=100), query(filter=parse_filter({"lang": "en"}, SETTINGS.fields))):
        assert_same(restored.search(q), shard.search(q))
    log.truncate_before(restored.applied_seq + 1)
    restored.save(tmp_path / "snap")
    assert_same(ShardIndex.load(tmp_path / "snap", SETTINGS).search(query()), shard.search(query()))


def test_a_snapshot_is_replaced_atomically_and_checked(tmp_path: Path):
    shard = ShardIndex(SETTINGS)
    shard.apply(entries(1)[0])
    shard.save(tmp_path)
    shard.apply(entries(2)[1])
    shard.save(tmp_path)
    folders = [p.name for p in tmp_path.iterdir() if p.name.startswith("snap-")]
    assert len(folders) == 1 and (tmp_path / "CURRENT").read_text() == folders[0]
    assert ShardIndex.load(tmp_path, SETTINGS).applied_seq == 2
    (tmp_path / folders[0] / "docs.msgpack").write_bytes(b"\x90")
    with pytest.raises(CorruptSnapshot):
        ShardIndex.load(tmp_path, SETTINGS)
    assert not snapshot.exists(tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError):
        ShardIndex.load(tmp_path / "elsewhere", SETTINGS)


def test_compaction_keeps_results(tmp_path: Path):
    compacting = ShardIndex(SETTINGS, dense_fresh_limit=8, compact_min_dead=4, compact_fraction=0.2)
    plain = ShardIndex(SETTINGS, compact_min_dead=10**9)
    log = [
        *entries(5),
        LogEntry(seq=6, ops=[Delete(id=f"d{i}") for i in range(0, 50, 3)]),
        LogEntry(seq=7, ops=[doc(1), doc(2)]),
    ]
    for e in log:
        compacting.apply(e)
        plain.apply(e)
    assert compacting.statistics()["slots"] < plain.statistics()["slots"]
    for q in (query(k=100), query(filter=parse_filter({"year": 2002}, SETTINGS.fields))):
        assert_same(compacting.search(q), plain.search(q))


def assert_same(a, b) -> None:
    """The same hits in the same order, scores equal up to float32 rounding (a graph search and a brute-force
    product may sum in another order)."""
    for got, want in ((a.lexical, b.lexical), (a.dense, b.dense)):
        assert [h.id for h in got] == [h.id for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-6)
