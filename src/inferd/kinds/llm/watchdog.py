"""When an LLM worker counts as hung: the front end's watchdog policy (a plain object with an injected
clock and no I/O; LLMRuntime.run drives it and kills what it names).

A worker is killed, and its streams resume on other workers through failover, when
* it holds live sequences and has completed no engine step for longer than the hang timeout, counted
  from its last step or from when it last went from idle to busy, whichever is later (a device call
  that never returns: the worker's event loop, and so its heartbeat, may well be fine); or
* it has sent nothing, no heartbeat and no step, for `heartbeat_timeout_s` (a frozen process, a lost
  host).

The hang timeout is the model's `params.hang_timeout_s`, or by default HANG_STEP_FACTOR times the
slowest of the model's last HANG_STEPS steps, never under HANG_MIN_S (before any step: HANG_MIN_S).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inferd.clock import Clock

HANG_MIN_S = 5.0
HANG_STEP_FACTOR = 10.0
HANG_STEPS = 256


@dataclass(frozen=True, slots=True)
class WorkerProgress:
    """What the watchdog needs to know about one worker."""

    live: int
    """Sequences placed on it whose end the front end has not seen."""
    busy_since: float
    """When its live count last went from 0 to 1."""
    last_step_at: float
    last_heartbeat_at: float
    """Its last message of any kind (a step counts as a heartbeat)."""


class HangPolicy:
    def __init__(self, clock: Clock, hang_timeout_s: float | None, heartbeat_timeout_s: float) -> None:
        self.clock = clock
        self.hang_timeout_s = hang_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._steps: deque[float] = deque(maxlen=HANG_STEPS)

    def observe_step(self, compute_s: float) -> None:
        if compute_s > 0:
            self._steps.append(compute_s)

    def timeout_s(self) -> float:
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        return max(HANG_MIN_S, HANG_STEP_FACTOR * max(self._steps, default=0.0))

    def verdict(self, w: WorkerProgress) -> str:
        """Why the worker must be killed; empty when it is healthy."""
        now = self.clock.now()
        limit = self.timeout_s()
        stalled = now - max(w.last_step_at, w.busy_since)
        if w.live and stalled > limit:
            return (
                f"hung: no engine step for {stalled:.1f}s while it held {w.live} live sequence(s) "
                f"(hang timeout {limit:.1f}s)"
            )
        silent = now - w.last_heartbeat_at
        if silent > self.heartbeat_timeout_s:
            return f"went silent: no heartbeat for {silent:.1f}s"
        return ""
