"""The front end's side of one worker connection: its state, its in-flight batches, its socket."""

from __future__ import annotations

import asyncio
import enum
import re
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from inferd.observability import tracing
from inferd.wire import protocol as p


class WorkerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"

    TERMINAL: frozenset[WorkerState]


WorkerState.TERMINAL = frozenset({WorkerState.DEAD})

MAX_INFLIGHT = 2
"""One batch running on the device and at most one staged behind it (a worker without credits: the
front end assumes both slots are its own)."""


def slot_of(worker_id: str) -> str:
    """'sim-0.3' (slot sim-0, third restart) -> 'sim-0'; a pool model server's 'pool:p-0.3/a:1' -> its
    pool worker's slot, 'pool:p-0'."""
    return process_of(worker_id).rsplit(".", 1)[0]


def model_link_id(pool_worker_id: str, model: str, version: int) -> str:
    """The id a pool worker's model server joins with: `<pool worker id>/<model>:<version>`. Each model it
    holds is a worker of its own in the front end's directory (found, drained, listed apart from the
    others'); `process_of` maps it back to the pool worker's process (kill, healthy)."""
    return f"{pool_worker_id}/{model}:{version}"


_MODEL_LINK = re.compile(r"/[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}:[0-9]+$")
"""A `model_link_id`'s tail (a model name cannot hold '/' or ':', config.ModelConfig's rule)."""


def process_of(worker_id: str) -> str:
    """The id of the worker process serving `worker_id`: a pool model server's (`model_link_id`) is its
    pool worker's; any other id is its own."""
    tail = _MODEL_LINK.search(worker_id)
    return worker_id if tail is None or tail.start() == 0 else worker_id[: tail.start()]


class BatchItem(Protocol):
    """What the wire reads of a batch's item (the batch kind's QueuedItem, kinds/batch/queue.py)."""

    payload: Any


ItemT = TypeVar("ItemT", bound=BatchItem)


@dataclass(slots=True, eq=False)
class Batch(Generic[ItemT]):
    batch_id: int
    items: list[ItemT]
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
    inflight: dict[int, Batch[Any]] = field(default_factory=dict)
    credits: int | None = None
    """Batches the worker granted and this front end has not sent yet (worker/credits.py); None: a
    worker of an older inferd, which takes MAX_INFLIGHT batches from this front end."""
    worker_idle: bool = True
    """As the worker last said (Credit): nothing of any front end's runs on it."""
    shared: bool = False
    """The worker serves other front ends too: it grants on Demand, and slots unused go back."""
    running_items: int = 0
    """Items of the batch running on the worker, as it last said (Credit; any front end's); 0: none, or
    a worker that does not say."""
    demand_sent: int = 0
    """Queued items last reported to the worker (Demand) since the last batch sent there."""
    high_water: int = 0
    """The most batches the worker has held at once, from all its front ends (its heartbeat)."""
    zone: str | None = None
    """The zone the worker said it is in (Hello.zone); None: none."""

    @property
    def slot_id(self) -> str:
        """The supervisor slot this connection belongs to: its id without the restart count."""
        return slot_of(self.worker_id)

    @property
    def idle(self) -> bool:
        """A batch sent now would run at once."""
        if self.state is not WorkerState.READY or self.inflight:
            return False
        return self.credits is None or (self.credits > 0 and (self.worker_idle or not self.shared))

    @property
    def stage_free(self) -> bool:
        """A batch sent now would be staged behind a running one."""
        if self.state is not WorkerState.READY:
            return False
        if self.credits is None:
            return 0 < len(self.inflight) < MAX_INFLIGHT
        return self.credits > 0 and not self.idle

    def on_credit(self, msg: p.Credit, now: float) -> None:
        """The worker granted slots, or its state changed."""
        if self.credits is None:
            return
        if msg.running_items >= 0:  # the worker says what runs on it: staging times count from that batch
            if not self.inflight:  # (with a batch of its own in flight, its own times stay)
                self.running_since = now - msg.running_for_s
            self.running_items = msg.running_items
        elif self.worker_idle and not msg.idle and not self.inflight:
            self.running_since = now  # (a worker that does not say) another front end's batch started
        self.credits += msg.granted
        self.worker_idle = msg.idle
        self.shared = msg.shared

    def send_batch(self, batch: Batch) -> None:
        if self.credits is not None:
            self.credits -= 1
            self.worker_idle = False
            self.demand_sent = 0
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
