"""Local workers that outlive the front end that started them (`inferd serve --frontends N`).

With several front ends, the owner (front end 0) runs the local workers, and each joins every front
end with `--reconnect`: when the owner dies, its workers go on serving the other front ends and rejoin
the owner when the parent starts it again. The parent is the workers' subreaper (runner/parent.py):
orphaned, they become its children, and it reaps them.

A restarted owner's supervisor finds them (`survivors`): the processes running `inferd.worker.main`
joined at this server's worker address (a folder of its own, so no other server's), each naming its
slot and incarnation in `--worker-id MODEL-INDEX.RESTARTS` and `--model-version`. It adopts each slot's
worker that still runs (`Adopted`, watched by pid and command line) instead of starting a second one;
a survivor that no slot wants is stopped.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

log = logging.getLogger("inferd.supervisor")


@dataclass(frozen=True, slots=True)
class Survivor:
    """A worker found running: its slot, its incarnation's restart count, its pid."""

    model: str
    index: int
    version: int | None
    restarts: int
    pid: int

    @property
    def slot_key(self) -> tuple[str, int, int | None]:
        return (self.model, self.index, self.version)

    @property
    def incarnation(self) -> str:
        return f"{self.model}-{self.index}.{self.restarts}"


def _arguments(pid: int) -> dict[str, str] | None:
    """A worker process's `--name value` arguments; None for a process that is not a worker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "inferd.worker.main" not in args:
        return None
    return {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}


def _survivor(pid: int, args: dict[str, str]) -> Survivor | None:
    """The slot a worker's `--worker-id MODEL-INDEX.RESTARTS` names (None: not a slot's id)."""
    slot, _, restarts = args.get("--worker-id", "").rpartition(".")
    model, _, index = slot.rpartition("-")
    version = args.get("--model-version")
    if not model or not index.isdigit() or not restarts.isdigit() or not (version or "0").isdigit():
        return None
    return Survivor(model, int(index), int(version) if version else None, int(restarts), pid)


def survivors(address: str) -> list[Survivor]:
    """The workers running that joined at `address`, newest incarnation first."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: nothing to adopt (the previous owner's workers went with it)
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        args = _arguments(int(entry))
        if args is None or args.get("--connect") != address or not running(int(entry)):
            continue
        survivor = _survivor(int(entry), args)
        if survivor is not None:
            found.append(survivor)
    return sorted(found, key=lambda s: -s.restarts)


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: it exited and waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def runs_as(pid: int, incarnation: str, address: str) -> bool:
    """Whether `pid` is the worker `incarnation` joined at `address` (not another process that got
    its pid since)."""
    args = _arguments(pid)
    return (
        args is not None
        and args.get("--worker-id") == incarnation
        and args.get("--connect") == address
        and running(pid)
    )


class Adopted:
    """A worker started by a previous owner: not a child of this process, so watched by its pid (and
    its command line, should the pid be reused once it is gone)."""

    def __init__(self, pid: int, incarnation: str, address: str) -> None:
        self.pid = pid
        self.incarnation = incarnation
        self.address = address

    @property
    def returncode(self) -> int | None:
        """None while it runs; then -1 (its exit code went to its parent, the subreaper)."""
        return None if runs_as(self.pid, self.incarnation, self.address) else -1

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # gone since
            except PermissionError as exc:
                log.warning("cannot signal worker %s (pid %d): %s", self.incarnation, self.pid, exc)
