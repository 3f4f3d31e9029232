"""What the benchmarks read from /proc (Linux): a server's processes (its descendants and the members of
its session, orphans reparented to init included), their CPU time and resident memory, and how busy the
whole machine was."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (0 state, 1 ppid, 3 session, 11 utime, 12 stime);
    None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def _live_processes() -> dict[int, tuple[int, int]]:
    """Every live (not zombie) process: pid -> (parent pid, session id)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        f = _stat_fields(int(name))
        if f is not None and f[0] != "Z":
            table[int(name)] = (int(f[1]), int(f[3]))
    return table


def _with_descendants(table: dict[int, tuple[int, int]], roots: set[int]) -> set[int]:
    found = set(roots)
    while below := {pid for pid, (ppid, _) in table.items() if ppid in found} - found:
        found |= below
    return found


def process_tree(root: int | None, session: int | None = None) -> set[int]:
    """`root` and with `session` every live process of that session, and their live descendants."""
    table = _live_processes()
    roots = {root} & table.keys() if root is not None else set()
    if session is not None:
        roots |= {pid for pid, (_, sid) in table.items() if sid == session}
    return _with_descendants(table, roots)


def processes_mentioning(text: str) -> set[int]:
    """Live processes whose command line contains `text`, and their descendants."""
    table = _live_processes()
    needle = text.encode()
    roots = set()
    for pid in table:
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                roots.add(pid)
        except OSError:
            continue
    return _with_descendants(table, roots)


def in_session(pids: Iterable[int], session: int) -> set[int]:
    """Those of `pids` that are still live members of `session` (a reused pid is not)."""
    out = set()
    for pid in pids:
        f = _stat_fields(pid)
        if f is not None and f[0] != "Z" and int(f[3]) == session:
            out.add(pid)
    return out


def cpu_ticks(pids: Iterable[int]) -> dict[int, int]:
    """utime + stime of each process still there, in clock ticks."""
    out = {}
    for pid in pids:
        f = _stat_fields(pid)
        if f is not None:
            out[pid] = int(f[11]) + int(f[12])
    return out


def cpu_seconds(pids: Iterable[int]) -> float:
    return sum(cpu_ticks(pids).values()) / CLK_TCK


def cpu_seconds_since(before: dict[int, int], pids: Iterable[int]) -> float:
    """CPU seconds `pids` used since the `before` reading; a process that appeared since counts whole."""
    after = cpu_ticks(pids)
    return sum(t - before.get(pid, 0) for pid, t in after.items()) / CLK_TCK


def status_kib(pid: int | str, field: str) -> int | None:
    """A memory field of /proc/PID/status in KiB (VmRSS, VmHWM, ...); None when absent or gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key == field:
            return int(value.split()[0])
    return None


def rss_mib_by_pid(pids: Iterable[int]) -> dict[int, float]:
    """Resident memory of each process still there, in MiB."""
    out = {}
    for pid in pids:
        kib = status_kib(pid, "VmRSS")
        if kib is not None:
            out[pid] = kib / 1024
    return out


def rss_mib(pids: Iterable[int]) -> float:
    """Resident memory of `pids` together, in MiB (shared pages counted once per process)."""
    return sum(rss_mib_by_pid(pids).values())


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, not idle or iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK


class RssSampler(threading.Thread):
    """Peak resident memory (MiB) of a set of processes, sampled every `every_s` until `finish()`."""

    def __init__(self, pids: set[int], every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.every_s = every_s
        self.peak_mib = rss_mib(pids)
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            self.peak_mib = max(self.peak_mib, rss_mib(self.pids))

    def finish(self) -> float:
        self._done.set()
        self.join()
        return self.peak_mib
