"""What the parts of one batch model's runtime share (dispatch, delivery, the watchdog, membership).

One object, passed to each part, so that a rolling update's new config (`config` is replaced, never
changed) is seen by all of them at once, and so that each part names the shared state it touches.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.kinds.batch.admission import DrainEstimator
from inferd.kinds.batch.queue import QueuedItem, RequestQueue
from inferd.observability.metrics import ModelMetrics
from inferd.wire.connection import WorkerConnection, WorkerState


@dataclass(eq=False)
class ModelState:
    config: ModelConfig
    """Replaced by a rolling update: workers that connect afterwards load the new version."""
    clock: Clock
    metrics: ModelMetrics
    queue: RequestQueue
    estimator: DrainEstimator
    """Batch latency and size, measured: admission, hedging and the batch timeout read it."""
    isolation: deque[list[QueuedItem]] = field(default_factory=deque)
    """Groups of a failed batch, each to run as a batch of its own ahead of the queue."""
    workers: list[WorkerConnection] = field(default_factory=list)
    """Ready and draining connections; a lost one leaves at once."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when something may let a batch go: an arrival, a completion, a worker joining or leaving."""
    wake_queued: int = 1
    """An arrival sets `wake` only once the queue holds this many items: until then the last decision
    stands (the dispatch loop sets it after each pass from CutDecision.wake_queued)."""
    stopping: bool = False
    """The server is shutting down (or the dispatch loop failed): no new work is accepted."""
    _loop: asyncio.AbstractEventLoop | None = None

    def running_loop(self) -> asyncio.AbstractEventLoop:
        """The running event loop (the replies' futures are its), looked up once while it runs:
        asyncio.get_running_loop costs a getpid() system call each time."""
        if self._loop is None or not self._loop.is_running():
            self._loop = asyncio.get_running_loop()
        return self._loop

    @property
    def name(self) -> str:
        return self.config.name

    def ready_workers(self) -> int:
        return len([w for w in self.workers if w.state is WorkerState.READY])  # per request: kept cheap

    def isolated_items(self) -> int:
        """Items waiting in isolation groups whose callers still wait."""
        return sum(1 for group in self.isolation for item in group if not item.reply.done())
