"""Snapshot directories, written atomically: a reader sees the previous snapshot or the new one, never a mix.

Layout of `directory`: one `snap-<applied_seq>` folder per snapshot (its files plus `meta.json`, which
holds applied_seq, the caller's metadata and a CRC32 per file) and `CURRENT`, naming the live folder.
`write` fills a temporary folder, fsyncs every file and the folder, renames it into place, then replaces
CURRENT (temp file + fsync + rename + fsync of the directory) and only then removes older folders. A crash at
any point leaves CURRENT naming a complete folder (or no CURRENT yet: no snapshot).

Over the wire a snapshot travels as one blob (`pack`/`unpack`: applied_seq, files and metadata, with a
CRC32 per file as on disk), cut into chunks of at most CHUNK_BYTES (`chunks`): a replica answers the
writer's "snapshot" call with its index packed, and the writer sends a replica the snapshot it keeps in
its data_dir inside ShardAssign. No replica reads or writes a data_dir.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

import msgspec

from inferd.kinds.search.types import CorruptSnapshot

CURRENT = "CURRENT"
META = "meta.json"
CHUNK_BYTES = 8 * 2**20
"""The most snapshot bytes in one message (a ShardAssign, a "snapshot" call's answer)."""

_packer = msgspec.msgpack.Encoder()
_unpacker = msgspec.msgpack.Decoder(tuple[int, dict[str, bytes], dict[str, int], dict[str, Any]])


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def exists(directory: Path) -> bool:
    """Whether `directory` holds a snapshot."""
    return (Path(directory) / CURRENT).is_file()


def write(directory: Path, applied_seq: int, files: dict[str, bytes], meta: dict[str, Any]) -> Path:
    """Write a snapshot atomically; returns its folder."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"snap-{applied_seq:012d}-{uuid.uuid4().hex[:8]}"
    temp = directory / f".{name}.tmp"
    temp.mkdir()
    for file_name, data in files.items():
        _write_file(temp / file_name, data)
    checks = {file_name: zlib.crc32(data) for file_name, data in files.items()}
    head = {"applied_seq": applied_seq, "files": checks, "meta": meta}
    _write_file(temp / META, json.dumps(head, sort_keys=True).encode())
    _fsync_path(temp)
    final = directory / name
    os.rename(temp, final)
    _write_file(directory / f".{CURRENT}.tmp", name.encode())
    os.replace(directory / f".{CURRENT}.tmp", directory / CURRENT)
    _fsync_path(directory)
    for old in directory.iterdir():
        if old.name != name and (old.name.startswith("snap-") or old.name.startswith(".snap-")):
            shutil.rmtree(old, ignore_errors=True)
    return final


def current_seq(directory: Path) -> int:
    """The applied_seq of the current snapshot, read from its meta.json only; -1 when there is none (or
    it is unreadable: loading it would fail too)."""
    directory = Path(directory)
    try:
        name = (directory / CURRENT).read_text().strip()
        return int(json.loads((directory / name / META).read_text())["applied_seq"])
    except (OSError, ValueError, KeyError):
        return -1


def read(directory: Path) -> tuple[int, dict[str, bytes], dict[str, Any]]:
    """(applied_seq, files, meta) of the current snapshot; FileNotFoundError when there is none,
    CorruptSnapshot when its files are missing or do not match their checksums."""
    directory = Path(directory)
    pointer = directory / CURRENT
    if not pointer.is_file():
        raise FileNotFoundError(f"no snapshot in {directory} (no {CURRENT} file)")
    folder = directory / pointer.read_text().strip()
    try:
        head = json.loads((folder / META).read_text())
        files = {name: (folder / name).read_bytes() for name in head["files"]}
    except (OSError, ValueError, KeyError) as exc:
        raise CorruptSnapshot(f"snapshot {folder} is unreadable: {exc}") from exc
    for name, crc in head["files"].items():
        if zlib.crc32(files[name]) != crc:
            raise CorruptSnapshot(f"snapshot {folder}: {name} does not match its checksum")
    return int(head["applied_seq"]), files, head["meta"]


def pack(applied_seq: int, files: dict[str, bytes], meta: dict[str, Any]) -> bytes:
    """A snapshot as one blob, for the wire."""
    checks = {name: zlib.crc32(data) for name, data in files.items()}
    return _packer.encode((applied_seq, files, checks, meta))


def unpack(data: bytes) -> tuple[int, dict[str, bytes], dict[str, Any]]:
    """(applied_seq, files, meta) of a packed snapshot; CorruptSnapshot when it does not decode or a file
    does not match its checksum."""
    try:
        applied_seq, files, checks, meta = _unpacker.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptSnapshot(f"a snapshot received does not decode: {exc}") from exc
    if set(checks) != set(files) or any(zlib.crc32(files[n]) != crc for n, crc in checks.items()):
        raise CorruptSnapshot("a snapshot received does not match its checksums")
    return applied_seq, files, meta


def read_packed(directory: Path) -> tuple[int, bytes] | None:
    """The current snapshot of `directory`, packed, with its seq; None when there is none."""
    try:
        applied_seq, files, meta = read(directory)
    except FileNotFoundError:
        return None
    return applied_seq, pack(applied_seq, files, meta)


def chunks(data: bytes, size: int = CHUNK_BYTES) -> list[bytes]:
    """`data` cut into pieces of at most `size` bytes (one empty piece for no data)."""
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]
