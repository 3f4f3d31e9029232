"""The shard write-ahead log: group-commit appends, torn tails cut at open, read_from, truncate_before."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.kinds.search.types import CorruptLog, Delete, Document, LogEntry, SeqGap, Upsert
from inferd.kinds.search.wal import WriteAheadLog


def entry(seq: int) -> LogEntry:
    return LogEntry(
        seq=seq,
        ops=[
            Upsert(doc=Document(id=f"d{seq}", text=f"text {seq} " * seq), vector=bytes(range(8))),
            Delete(id="x"),
        ],
    )


def test_entries_come_back_in_order_after_reopen(tmp_path: Path):
    path = tmp_path / "shard.wal"
    with WriteAheadLog(path) as log:
        log.append([entry(1), entry(2)])
        log.append([entry(3)])
        assert [e.seq for e in log.read_from(2)] == [2, 3]
    with WriteAheadLog(path) as log:
        assert log.last_seq == 3
        assert list(log.read_from(1)) == [entry(1), entry(2), entry(3)]
        assert list(log.read_from(4)) == []


def test_append_refuses_a_gap_and_writes_nothing(tmp_path: Path):
    with WriteAheadLog(tmp_path / "w") as log:
        log.append([entry(1)])
        with pytest.raises(SeqGap):
            log.append([entry(2), entry(4)])
        assert log.last_seq == 1
    with WriteAheadLog(tmp_path / "w") as log:
        assert log.last_seq == 1


def test_a_crash_at_any_byte_of_the_last_record_keeps_every_earlier_one(tmp_path: Path):
    path = tmp_path / "w"
    with WriteAheadLog(path) as log:
        log.append([entry(1), entry(2)])
        start = path.stat().st_size
        log.append([entry(3)])
    whole = path.read_bytes()
    for cut in range(start, len(whole)):
        path.write_bytes(whole[:cut])
        with WriteAheadLog(path) as log:
            assert log.last_seq == 2, cut
            assert list(log.read_from(1)) == [entry(1), entry(2)], cut
            log.append([entry(3)])  # the log goes on where the torn record was
        with WriteAheadLog(path) as log:
            assert list(log.read_from(1)) == [entry(1), entry(2), entry(3)], cut


def test_a_flipped_byte_in_the_tail_fails_its_checksum_and_is_cut(tmp_path: Path):
    path = tmp_path / "w"
    with WriteAheadLog(path) as log:
        log.append([entry(1)])
        start = path.stat().st_size
        log.append([entry(2)])
    data = bytearray(path.read_bytes())
    for offset in (start + 3, start + 9, len(data) - 1):  # length, checksum, payload
        corrupt = data.copy()
        corrupt[offset] ^= 0x40
        path.write_bytes(bytes(corrupt))
        with WriteAheadLog(path) as log:
            assert [e.seq for e in log.read_from(1)] == [1]
        assert path.stat().st_size == start


def test_truncate_before_drops_covered_entries_and_keeps_last_seq(tmp_path: Path):
    path = tmp_path / "w"
    with WriteAheadLog(path) as log:
        log.append([entry(i) for i in range(1, 6)])
        log.truncate_before(4)
        assert [e.seq for e in log.read_from(1)] == [4, 5]
        log.append([entry(6)])
        log.truncate_before(7)
        assert list(log.read_from(1)) == []
        assert log.last_seq == 6
    with WriteAheadLog(path) as log:
        assert log.last_seq == 6
        log.truncate_before(20)  # a newer snapshot: the log continues after it
        log.append([entry(20)])
    with WriteAheadLog(path) as log:
        assert [e.seq for e in log.read_from(0)] == [20]


def test_a_file_that_is_not_a_log_is_refused(tmp_path: Path):
    path = tmp_path / "w"
    path.write_bytes(b"something else entirely, long enough")
    with pytest.raises(CorruptLog):
        WriteAheadLog(path)
