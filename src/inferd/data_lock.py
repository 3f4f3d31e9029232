"""One server per data directory: `inferd serve` holds an exclusive lock (fcntl.flock) on
DATA_DIR/inferd.lock for its whole life, and a second server given the same folder is refused at start,
naming the first one's pid and address, with the fix (its own --data-dir).

The lock belongs to the server, not to each of its front ends: the front ends of one `--frontends N`
server share its data folder (front end 0 owns the search indexes there) and run under the parent that
took the lock. The kernel drops the lock when the process ends, however it ends: a server that crashed
never blocks its restart. The file's contents (pid, address, front end id) are only what the refusal
says; the lock is what counts.

A data folder that cannot be created or written (a read-only root file system in a container, where
nothing is stored there either) is not locked: logged, and the server starts.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from inferd.config import ConfigError

log = logging.getLogger("inferd.server")

LOCK_NAME = "inferd.lock"


@dataclass(frozen=True, slots=True)
class DataDirLock:
    """The held lock (None: the folder could not be written, nothing held). Keep it for the process's
    life: the lock goes with the file descriptor."""

    path: Path
    fd: int | None


def hold_data_dir(data_dir: Path, address: str, frontend: str) -> DataDirLock:
    """Take DATA_DIR's lock for this process (`address`: its HTTP HOST:PORT, `frontend`: its front end
    id, both written for a second server's refusal); ConfigError naming the holder when another live
    server holds it."""
    path = data_dir / LOCK_NAME
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.warning(
            "data folder %s cannot be written (%s): not locked against a second server; search indexes "
            "cannot be stored there (pass --data-dir with a writable folder to keep them)",
            data_dir,
            exc.strerror or exc,
        )
        return DataDirLock(path, None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(
            f"data folder {data_dir} is in use by another inferd server ({holder}): each server needs a "
            "folder of its own; pass --data-dir with another folder (or stop that server)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "address": address, "frontend_id": frontend}).encode(), 0)
    return DataDirLock(path, fd)


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says."""
    try:
        raw = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {raw['pid']}, serving on {raw['address']}, front end id {raw['frontend_id']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid and address not written yet"
