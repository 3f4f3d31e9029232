"""How many threads llama.cpp's CPU kernels use, adapted to what else runs on the machine.

llama.cpp splits every step over `n_threads` threads that wait for each other: when another process
takes one of the cores they run on, every step waits for the starved thread (measured on 2 cores, 8
smollm2 streams: 163 tokens/s quiet, under 3 tokens/s with a CPU hog pinned to one core at 2 threads).
Fewer threads than cores loses batched throughput on a quiet machine (1 thread: 8 streams at 1.25x one
stream instead of 1.8x), so neither fixed default holds both. With `params.n_threads = 0` (the default)
the backend watches the other processes' CPU use and runs on the cores they leave free.

`ThreadPolicy` is the decision (pure, no I/O); `CpuWatch` measures, from /proc/stat and this process's
own CPU time, how many cores the rest of the machine kept busy since its last look.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

SAMPLE_S = 0.5
"""How often the worker looks at the machine's CPU use."""


@dataclass
class ThreadPolicy:
    usable_cores: int
    """Cores this process may run on (its CPU affinity)."""
    smoothing: float = 0.5
    """EWMA weight of the newest sample of the others' CPU use."""
    others_cores: float = 0.0

    def decide(self, others_busy_cores: float) -> int:
        """Threads for the next steps: the cores the others leave free. A core counts as taken once the
        others (smoothed) use more than 0.7 of it, so a light load (the front end, a client: a few
        tenths of a core) keeps every core and a busy process costs one; at least one."""
        self.others_cores += self.smoothing * (max(0.0, others_busy_cores) - self.others_cores)
        free = self.usable_cores - self.others_cores
        return max(1, min(self.usable_cores, int(free + 0.7)))


class CpuWatch:
    """Cores the other processes kept busy: the machine's busy time (/proc/stat) minus this process's."""

    def __init__(self, stat_path: str = "/proc/stat") -> None:
        self.stat_path = stat_path
        self.ticks_per_s = os.sysconf("SC_CLK_TCK")
        self._last: tuple[float, float, float] | None = None

    def sample(self) -> float | None:
        """Busy cores of the others since the previous sample (None on the first, or without /proc)."""
        try:
            with open(self.stat_path) as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        if len(fields) < 4:
            return None
        busy_s = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / self.ticks_per_s
        now, own_s = time.monotonic(), time.process_time()
        last, self._last = self._last, (now, busy_s, own_s)
        if last is None or now - last[0] <= 0:
            return None
        return max(0.0, (busy_s - last[1]) - (own_s - last[2])) / (now - last[0])


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
