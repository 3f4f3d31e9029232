"""What an LLM model's front end reports: its frozen snapshots, and the recent time-to-first-token
signal (a windowed p90) an autoscaler can target."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from inferd.clock import Clock

TTFT_WINDOW_S = 30.0
"""First tokens older than this no longer count in the TTFT signal."""
TTFT_MAX_SAMPLES = 4096
"""The window keeps at most this many (the most recent) first tokens."""


@dataclass(frozen=True, slots=True)
class LLMRuntimeStatistics:
    """Summed over the model's workers (as of each worker's last step), plus front-end counts."""

    workers: int
    streams: int
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    steps: int
    finished: int
    aborted: int
    errored: int
    client_aborts: int
    rejected: int
    """Requests refused with Overloaded at admission (no ready worker's queue had room)."""
    moved: int
    """Streams placed on another worker after theirs died (resubmitted or resumed)."""
    lost: int
    """Streams ended with WorkerDied: their worker died and no worker or retry budget was left."""
    prefix_hit_tokens: int
    """Prompt tokens the engines found in their prefix caches (hit / query is the hit ratio)."""
    prefix_query_tokens: int
    deadline_aborts: int = 0
    """Sequences ended (and aborted in their engine) because the caller's deadline passed."""
    hung_workers: int = 0
    """Workers killed by the watchdog: no step while sequences ran, or no heartbeat."""
    ttft_s: float | None = None
    """p90 of the time to first token over the last TTFT_WINDOW_S seconds; None: no first token then."""
    ttft_samples: int = 0
    """First tokens in that window."""
    hang_timeout_s: float = 0.0
    """The watchdog's current limit on a step (the setting, or derived from recent step times)."""
    held: int = 0
    """Sequences waiting for a worker with none in service (kinds/llm/cold.py): the demand to scale from zero."""
    cold_for_s: float | None = None
    """How long the cold start under way has held requests; None: none under way."""


@dataclass(frozen=True, slots=True)
class LLMWorkerStatistics:
    """One LLM worker's engine, as of its last step (WorkerSnapshot.detail)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    unadmitted: int
    """Sequences sent to it that its engine has not yet admitted (the front end's count)."""
    failure: str
    """Why the watchdog is killing it; empty while healthy."""


class TTFTWindow:
    """Times to first token of the last TTFT_WINDOW_S seconds (at most TTFT_MAX_SAMPLES of them)."""

    def __init__(self, clock: Clock, window_s: float = TTFT_WINDOW_S) -> None:
        self.clock = clock
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=TTFT_MAX_SAMPLES)

    def observe(self, ttft_s: float) -> None:
        self._samples.append((self.clock.now(), ttft_s))

    def p90(self) -> tuple[float | None, int]:
        """(p90 in seconds or None, samples in the window)."""
        horizon = self.clock.now() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        if not self._samples:
            return None, 0
        values = sorted(v for _, v in self._samples)
        return values[math.ceil(0.9 * len(values)) - 1], len(values)
