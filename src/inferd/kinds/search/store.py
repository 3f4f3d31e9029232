"""Where indexes live on disk, under the server's data_dir:

    DATA_DIR/indexes/NAME/index.json        settings of an index created through the API
    DATA_DIR/indexes/NAME/shard-N/wal       the shard's write-ahead log (its writer front end writes it)
    DATA_DIR/indexes/NAME/shard-N/snapshot/ its latest snapshot (the writer writes what a replica sent)
    DATA_DIR/indexes/NAME/writer.json       the lease epoch under which these logs were last written

Those are the first front end's of its host; another of `--frontends N` (which shares the data_dir) keeps
its own, suffixed with its id (`wal.ID`, `snapshot.ID`, `writer.ID.json`): two writers never share a file.

An index declared in the model repository has no index.json (its settings are the repository's); its
logs and snapshots live here all the same, so its documents survive restarts too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from inferd.config import ModelConfig
from inferd.errors import BadRequest
from inferd.kinds.search.config import SearchParams, index_config, parse_params

log = logging.getLogger("inferd.search")

SETTINGS_FILE = "index.json"
EMBEDDER_FILE = "embedder.json"
"""The embedder version of an index's vectors, and the one a running re-embed moves to."""


class IndexStore:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir / "indexes"

    def folder(self, name: str) -> Path:
        return self.root / name

    def shard_folder(self, name: str, shard: int) -> Path:
        return self.folder(name) / f"shard-{shard}"

    def wal_path(self, name: str, shard: int, writer: str = "") -> Path:
        return self.shard_folder(name, shard) / _own("wal", writer)

    def snapshot_path(self, name: str, shard: int, writer: str = "") -> Path:
        return self.shard_folder(name, shard) / _own("snapshot", writer)

    def written_epoch(self, name: str, writer: str = "") -> int:
        """The lease epoch under which this front end's logs of `name` were last written (0: never)."""
        try:
            with open(self.folder(name) / _own("writer", writer, ".json")) as f:
                return int(json.load(f).get("epoch", 0))
        except (FileNotFoundError, ValueError, AttributeError):
            return 0

    def save_written_epoch(self, name: str, epoch: int, writer: str = "") -> None:
        self._write(name, _own("writer", writer, ".json"), {"epoch": epoch})

    def save(self, name: str, params: SearchParams) -> None:
        """Record an API-created index (atomically: temp file, fsync, rename) so it is served again after
        a restart."""
        self._write(name, SETTINGS_FILE, params.model_dump())

    def embedder_versions(self, name: str) -> tuple[int | None, int | None]:
        """(the version of the index's vectors, the version a running re-embed moves to); None: unknown."""
        try:
            with open(self.folder(name) / EMBEDDER_FILE) as f:
                state = json.load(f)
        except FileNotFoundError:
            return None, None
        return state.get("version"), state.get("target")

    def save_embedder_versions(self, name: str, version: int | None, target: int | None) -> None:
        self._write(name, EMBEDDER_FILE, {"version": version, "target": target})

    def _write(self, name: str, file: str, value: object) -> None:
        folder = self.folder(name)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{file}.tmp"
        with open(tmp, "w") as f:
            json.dump(value, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / file)
        _fsync_dir(folder)

    def remove(self, name: str) -> None:
        """Forget an index and its documents."""
        folder = self.folder(name)
        if folder.exists():
            trash = folder.with_name(f".deleted-{name}")
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(folder, trash)  # gone at once for a restart; the bytes go next
            shutil.rmtree(trash, ignore_errors=True)

    def stored(self, skip: set[str]) -> list[ModelConfig]:
        """The API-created indexes to serve at start (a name in `skip` is declared elsewhere and wins)."""
        if not self.root.is_dir():
            return []
        configs = []
        for folder in sorted(self.root.iterdir()):
            settings = folder / SETTINGS_FILE
            if folder.name.startswith(".") or folder.name in skip or not settings.is_file():
                continue
            try:
                params = parse_params(json.loads(settings.read_text()), str(settings))
            except (BadRequest, ValueError) as exc:
                log.error("index %s is not served: %s", folder.name, exc)
                continue
            configs.append(index_config(folder.name, params))
        return configs


def _own(base: str, writer: str, ext: str = "") -> str:
    """A writer's file name: `base` for the first front end of its host, else suffixed with its id."""
    if not writer:
        return base + ext
    return f"{base}.{''.join(c if c.isalnum() or c in '-_' else '_' for c in writer)}{ext}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
