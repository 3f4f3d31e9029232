"""Local workers that outlive the front end that started them (`inferd serve --frontends N`).

With several front ends, the owner (front end 0) runs the local workers, and each joins every front
end with `--reconnect`: when the owner dies, its workers go on serving the other front ends and rejoin
the owner when the parent starts it again. The parent is the workers' subreaper (frontends/parent.py):
orphaned, they become its children, and it reaps them.

The owner's supervisor keeps a record of its workers (`WorkerRecord`, a JSON file in the parent's
socket folder, rewritten at each start): slot, incarnation and pid. A restarted owner reads it and
adopts each slot's worker that still runs (`Adopted`, watched by pid), instead of starting a second
one; a recorded worker is its own only if its command line still names the slot's incarnation and
this server's worker address (a pid can be reused). A survivor that no slot wants is stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from dataclasses import asdict, dataclass

log = logging.getLogger("inferd.supervisor")


@dataclass(frozen=True, slots=True)
class Survivor:
    """One recorded worker: its slot, its incarnation's restart count, its pid."""

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


class WorkerRecord:
    """The owner's workers, in a file that outlives it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self) -> list[Survivor]:
        """What the previous owner recorded ([] when nothing, or a torn file)."""
        try:
            with open(self.path) as f:
                return [Survivor(**row) for row in json.load(f)]
        except (OSError, ValueError, TypeError):
            return []

    def write(self, workers: list[Survivor]) -> None:
        """Replace the record at once (write, then rename)."""
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump([asdict(w) for w in workers], f)
        os.replace(tmp, self.path)


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
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    named = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    return (
        "inferd.worker.main" in args
        and named.get("--worker-id") == incarnation
        and named.get("--connect") == address
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
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)
