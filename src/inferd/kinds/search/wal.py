"""The write-ahead log of one shard: framed records, one write and one fsync per append (group commit).

File layout: a 24-byte header (magic, base_seq, CRC32 of both), then records. A record is
`length (u32 LE) | crc32 of payload (u32 LE) | payload`, the payload a msgpack-encoded LogEntry. Entries
are consecutive: the first has seq base_seq + 1, each next one seq + 1.

At open the file is scanned; the first record that is short (a torn write), fails its checksum, does not
decode or breaks the seq order ends the log: the file is cut there (and fsynced), so everything before it
is kept and nothing partial is ever read. `truncate_before(seq)` rewrites the file without the entries a
snapshot covers (temp file + fsync + rename), keeping base_seq so last_seq survives an empty log.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgspec

from inferd.kinds.search.types import CorruptLog, LogEntry, SeqGap

MAGIC = b"INFDWAL1"
_HEADER = struct.Struct("<8sQI4x")
_FRAME = struct.Struct("<II")
MAX_RECORD = 1 << 30

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LogEntry)


def _header(base_seq: int) -> bytes:
    crc = zlib.crc32(MAGIC + base_seq.to_bytes(8, "little"))
    return _HEADER.pack(MAGIC, base_seq, crc)


def _frame(entry: LogEntry) -> bytes:
    payload = _encoder.encode(entry)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


class WriteAheadLog:
    """Append-only and single-writer; `read_from` may run between appends."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.base_seq = 0
        self._offsets: list[int] = []  # file offset of entry base_seq + 1 + i
        self._end = _HEADER.size
        self._fd = self._open()

    @property
    def last_seq(self) -> int:
        return self.base_seq + len(self._offsets)

    def _open(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        data = os.pread(fd, os.fstat(fd).st_size, 0)
        if len(data) >= _HEADER.size and data[: _HEADER.size] != _header(_HEADER.unpack_from(data)[1]):
            os.close(fd)
            raise CorruptLog(
                f"{self.path} is not a write-ahead log (bad header); move it away to start empty"
            )
        if len(data) < _HEADER.size:
            if data:  # not even a whole header: the file was being created; start it again
                os.ftruncate(fd, 0)
            os.pwrite(fd, _header(0), 0)
            os.fsync(fd)
            _fsync_dir(self.path.parent)
            return fd
        self.base_seq = _HEADER.unpack_from(data)[1]
        self._end = self._scan(data)
        if self._end < len(data):
            os.ftruncate(fd, self._end)
            os.fsync(fd)
        return fd

    def _scan(self, data: bytes) -> int:
        """Index the valid records of `data`; returns where they end."""
        offset = _HEADER.size
        expected = self.base_seq + 1
        while offset + _FRAME.size <= len(data):
            length, crc = _FRAME.unpack_from(data, offset)
            start = offset + _FRAME.size
            payload = data[start : start + length]
            if length > MAX_RECORD or len(payload) < length or zlib.crc32(payload) != crc:
                break
            try:
                seq = _decoder.decode(payload).seq
            except msgspec.DecodeError:
                break
            if seq != expected:
                break
            self._offsets.append(offset)
            expected += 1
            offset = start + length
        return offset

    def append(self, entries: list[LogEntry]) -> None:
        """Make `entries` durable: one write, one fsync. Their seqs must continue the log without gaps."""
        if not entries:
            return
        for i, entry in enumerate(entries):
            if entry.seq != self.last_seq + 1 + i:
                raise SeqGap(
                    f"{self.path}: entry seq {entry.seq} does not follow {self.last_seq + i}",
                    applied_seq=self.last_seq + i,
                    got=entry.seq,
                )
        frames = [_frame(e) for e in entries]
        data = b"".join(frames)
        written = os.pwrite(self._fd, data, self._end)
        if written != len(data):
            os.ftruncate(self._fd, self._end)
            raise OSError(f"{self.path}: short write ({written} of {len(data)} bytes)")
        os.fsync(self._fd)
        for frame in frames:
            self._offsets.append(self._end)
            self._end += len(frame)

    def read_from(self, seq: int) -> Iterator[LogEntry]:
        """The entries with seq >= `seq`, in order (those appended while iterating included)."""
        i = max(seq - self.base_seq - 1, 0)
        while i < len(self._offsets):
            offset = self._offsets[i]
            length, _ = _FRAME.unpack(os.pread(self._fd, _FRAME.size, offset))
            yield _decoder.decode(os.pread(self._fd, length, offset + _FRAME.size))
            i += 1

    def truncate_before(self, seq: int) -> None:
        """Drop the entries with seq < `seq`. When `seq` is past the end, the log is empty afterwards and
        its next entry is `seq` (a shard restored from a newer snapshot continues from there)."""
        if seq <= self.base_seq + 1:
            return
        keep_from = min(seq - self.base_seq - 1, len(self._offsets))
        start = self._offsets[keep_from] if keep_from < len(self._offsets) else self._end
        rest = os.pread(self._fd, self._end - start, start)
        new_base = seq - 1
        temp = self.path.with_name(self.path.name + ".tmp")
        with open(temp, "wb") as f:
            f.write(_header(new_base) + rest)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.path)
        _fsync_dir(self.path.parent)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR)
        shift = start - _HEADER.size
        self._offsets = [o - shift for o in self._offsets[keep_from:]]
        self._end -= shift
        self.base_seq = new_base

    def reset(self, base_seq: int) -> None:
        """Empty the log, its next entry `base_seq + 1` (a new writer's log, based on the snapshot it took
        from a replica: entries of its own past that point were never acknowledged)."""
        temp = self.path.with_name(self.path.name + ".tmp")
        with open(temp, "wb") as f:
            f.write(_header(base_seq))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.path)
        _fsync_dir(self.path.parent)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR)
        self._offsets, self._end, self.base_seq = [], _HEADER.size, base_seq

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> WriteAheadLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
