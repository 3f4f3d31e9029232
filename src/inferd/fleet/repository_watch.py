"""What changed in a model repository folder between two reads (`--model-control poll`): each model
folder's fingerprint (its model.toml and version folders: names, sizes, modification times, two levels
deep, never the files' contents), and the models added, changed and removed since the last read. A plain
object: fleet/repository_poll.py reads the folder on its timer and acts on the changes."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

Fingerprint = tuple[tuple[str, int, int], ...]
"""(path inside the model folder, size, mtime_ns) of each entry, sorted."""


def fingerprints(repo: Path, only: Collection[str] = ()) -> dict[str, Fingerprint]:
    """Each model folder's fingerprint (a folder with a model.toml; `only`: these names alone). A folder
    that changes while it is read is read again next time (its entries read so far are kept)."""
    out: dict[str, Fingerprint] = {}
    try:
        folders = sorted(d for d in repo.iterdir() if not d.name.startswith("."))
    except OSError:
        return out  # the repository itself is gone: every model was removed
    for folder in folders:
        if (only and folder.name not in only) or not model_folder(folder):
            continue
        out[folder.name] = _fingerprint(folder)
    return out


def model_folder(folder: Path) -> bool:
    """Whether `folder` holds a model (its model.toml). One the server may not read (EACCES) counts: it is
    not removed, and reading it says why it does not load."""
    try:
        return (folder / "model.toml").is_file()
    except OSError:
        return True


def _fingerprint(folder: Path) -> Fingerprint:
    entries: list[tuple[str, int, int]] = []
    try:
        for entry in folder.iterdir():
            children = list(entry.iterdir()) if entry.is_dir() else []
            for path in [entry, *children]:
                stat = path.stat()
                entries.append((str(path.relative_to(folder)), stat.st_size if path.is_file() else 0, stat.st_mtime_ns))
    except OSError:
        pass  # removed while read: the next read sees what is left
    return tuple(sorted(entries))


@dataclass(frozen=True, slots=True)
class RepositoryChanges:
    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


class RepositoryWatch:
    """The last read of the repository, and what the next one changed."""

    def __init__(self, first: dict[str, Fingerprint]) -> None:
        self.last = first

    def update(self, now: dict[str, Fingerprint]) -> RepositoryChanges:
        before, self.last = self.last, now
        return RepositoryChanges(
            added=tuple(sorted(set(now) - set(before))),
            changed=tuple(sorted(n for n in set(now) & set(before) if now[n] != before[n])),
            removed=tuple(sorted(set(before) - set(now))),
        )
