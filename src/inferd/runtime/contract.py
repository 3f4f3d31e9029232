"""What every model kind's front-end runtime implements (batch, llm, upstream; search next).

The server, the admin API, fleet control, the autoscaling loop, the metrics collectors and `inferd
status` talk to a model only through this contract and its frozen snapshots, never through a runtime's
own attributes; they find its workers in the server's WorkerDirectory (runtime/membership.py), which
the hub keeps. A kind adds what it alone needs in its snapshot's `detail`, a frozen dataclass of its own.

Lifecycle: built by the composition root (server.py) -> `run()` as a supervised task -> workers join
(`add_worker`), answer (`on_message`), drain (`drain_worker`) or break (`on_worker_lost`) -> `stop(exc)`
fails what is still queued, then the task running `run()` is cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from inferd.config import ModelConfig
from inferd.errors import ServingError
from inferd.routing.locality import LocalityStatistics
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One worker of a runtime, as operators see it."""

    worker_id: str
    model: str
    version: int
    state: str
    """A WorkerState value: starting, ready, draining, dead."""
    pid: int
    host: str
    completed: int
    """Batches (batch kind) or engine steps (llm kind) completed."""
    load: int
    """What it holds now: batches in flight (batch) or live sequences (llm)."""
    busy_s: float
    last_progress_at: float
    last_heartbeat_at: float
    detail: Any = None
    """Kind-specific, frozen: e.g. the batch kind's latency and ejection record."""
    zone: str | None = None
    """The zone the worker said it is in (`inferd worker --zone`); None: none."""

    @classmethod
    def of(cls, w: WorkerConnection, load: int, detail: Any = None) -> WorkerSnapshot:
        """The connection's common fields, with the kind's own load and detail."""
        return cls(
            worker_id=w.worker_id,
            model=w.model,
            version=w.version,
            state=w.state.value,
            pid=w.pid,
            host=w.host,
            completed=w.completed_batches,
            load=load,
            busy_s=w.busy_s,
            last_progress_at=w.last_progress,
            last_heartbeat_at=w.last_heartbeat,
            detail=detail,
            zone=w.zone,
        )


@dataclass(frozen=True, slots=True)
class RuntimeStatistics:
    """A runtime at one instant. Every field is a plain value: the snapshot never changes after it is
    taken and holds no reference into the runtime."""

    name: str
    version: int
    kind: str
    ready: bool
    workers: tuple[WorkerSnapshot, ...]
    ready_workers: int
    queued: int
    """Work admitted and not yet started: queued items (batch), waiting sequences (llm)."""
    in_flight: int
    """Work started and not yet answered: items in running batches, running sequences, open upstream calls."""
    detail: Any = None
    """The kind's own frozen snapshot (BatchStatistics, LLMRuntimeStatistics, PoolStatistics, ...)."""
    locality: LocalityStatistics | None = None
    """Its zones' shares and what each was sent (routing/locality.py); None: a kind that routes by no zone."""


@runtime_checkable
class Runtime(Protocol):
    """One served version of one model on the front end."""

    kind: ClassVar[str]
    name: str
    config: ModelConfig

    @property
    def version(self) -> int: ...

    @property
    def ready(self) -> bool:
        """Takes requests now: a ready worker (or upstream), not stopping, making progress."""
        ...

    def statistics(self) -> RuntimeStatistics: ...

    async def run(self) -> None:
        """The runtime's own loops (dispatch, watchdog, probes) until cancelled."""
        ...

    def stop(self, exc: ServingError) -> None:
        """Refuse new work and fail everything not yet running with `exc` (server shutdown)."""
        ...

    # ---- workers (kinds without workers, like upstream, refuse them: `accepts_workers` is False) ----
    # The hub calls these; who the workers are is the server's WorkerDirectory's (runtime/membership.py):
    # a runtime with workers keeps them in its version's Membership, taken from it when it is built.
    accepts_workers: ClassVar[bool]

    def add_worker(self, worker: WorkerConnection) -> None: ...

    def on_message(self, worker: WorkerConnection, msg: p.Message) -> None:
        """A result from the worker (BatchDone, StepDeltas); heartbeats are the hub's."""
        ...

    def drain_worker(self, worker: WorkerConnection) -> None:
        """No new work for it; it finishes what it holds, then exits (the supervisor replaces it)."""
        ...

    def on_worker_lost(self, worker: WorkerConnection, reason: str) -> None:
        """Its connection broke: recover (retry, resume elsewhere) or fail what it held."""
        ...
