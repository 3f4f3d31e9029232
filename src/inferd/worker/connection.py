"""The front end's side of one worker connection: its state, its in-flight batches, its socket."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inferd.observability import tracing
from inferd.worker import protocol as p

if TYPE_CHECKING:
    from inferd.batching.queue import QueuedItem


class WorkerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"

    TERMINAL: frozenset[WorkerState]


WorkerState.TERMINAL = frozenset({WorkerState.DEAD})

MAX_INFLIGHT = 2
"""One batch running on the device and at most one staged behind it."""


def slot_of(worker_id: str) -> str:
    """'sim-0.3' (slot sim-0, third restart) -> 'sim-0'."""
    return worker_id.rsplit(".", 1)[0]


@dataclass(slots=True, eq=False)
class Batch:
    batch_id: int
    items: list[QueuedItem]
    sent_at: float
    worker: WorkerConnection
    hedged: bool = False
    """Its items were queued again for another worker because it ran far past its expected time."""
    span: Any = None
    """Its inferd.batch span, when it carries a sampled request (observability/tracing.py)."""


@dataclass(eq=False)
class WorkerConnection:
    worker_id: str
    model: str
    pid: int
    host: str
    writer: asyncio.StreamWriter
    version: int = 0
    state: WorkerState = WorkerState.STARTING
    connected_at: float = 0.0
    last_heartbeat: float = 0.0
    last_progress: float = 0.0
    last_dispatch: float = 0.0
    completed_batches: int = 0
    busy_s: float = 0.0
    running_since: float = 0.0
    """When the batch now on the device started (sent to an idle worker, or the previous one finished)."""
    failure: str = ""
    """Why the front end is killing this worker ('hang', 'no heartbeat'); empty while healthy."""
    inflight: dict[int, Batch] = field(default_factory=dict)

    @property
    def slot_id(self) -> str:
        """The supervisor slot this connection belongs to: its id without the restart count."""
        return slot_of(self.worker_id)

    @property
    def idle(self) -> bool:
        return self.state is WorkerState.READY and not self.inflight

    @property
    def stage_free(self) -> bool:
        return self.state is WorkerState.READY and 0 < len(self.inflight) < MAX_INFLIGHT

    def send_batch(self, batch: Batch) -> None:
        if not self.inflight:
            self.running_since = batch.sent_at
        self.inflight[batch.batch_id] = batch
        self.last_dispatch = batch.sent_at
        parent = "" if batch.span is None else tracing.traceparent(batch.span)
        self.writer.write(
            p.encode_frame(p.RunBatch(batch.batch_id, [i.payload for i in batch.items], parent))
        )

    def send(self, msg: p.Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(p.encode_frame(msg))

    def close(self) -> None:
        self.state = WorkerState.DEAD
        if not self.writer.is_closing():
            self.writer.close()
