"""The batch kind's frozen snapshots: `BatchStatistics` (RuntimeStatistics.detail) and `BatchWorkerDetail`
(WorkerSnapshot.detail). What the admin API, the scaling loop, the metrics collector and `inferd status`
read about a batch model, taken at one instant; nothing in them refers back into the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferd.routing.balancer import BalancerStatistics
from inferd.routing.ejection import EjectionRecord, EjectionStatistics
from inferd.wire.connection import WorkerConnection


@dataclass(frozen=True, slots=True)
class BatchStatistics:
    stalled: bool
    """Work is waiting or running, yet nothing completed within progress_timeout_s."""
    queued_items: int
    """Live items in the queue (what its bound counts); isolated items are not among them."""
    queued_interactive: int
    queued_bulk: int
    queue_capacity: int
    """The queue's bound in items (max_queue_size)."""
    isolation_batches: int
    """Groups of failed batches waiting to run on their own."""
    isolated_items: int
    inflight_batches: int
    """Batches sent to workers and not answered yet (running and staged)."""
    batch_timeout_s: float
    """A batch running longer has its worker killed as hung."""
    busy_ratio: float
    """Share of the last 10 s the devices spent computing, in [0, 1]."""
    balancer: BalancerStatistics
    ejection: EjectionStatistics
    enqueued_total: int
    """Items admitted since start (the autoscaler's arrival rate)."""
    batch_latency_s: float | None
    """EWMA of batch latency; None until a batch completed."""
    items_per_batch: float | None
    """EWMA of batch size; None until a batch completed."""
    full_batch_latency_s: float | None
    """A full batch's latency from the measured cost line; None until two batch sizes were measured."""
    loop_lag_s: float
    """EWMA of how late the event loop runs timers: the front end's own saturation."""
    max_batch_size: int
    cold_for_s: float | None = None
    """How long requests have been held with no worker in service, waiting for the one woken
    (kinds/batch/cold.py); None: no cold start under way."""


@dataclass(frozen=True, slots=True)
class BatchWorkerDetail:
    slot_id: str
    """The supervisor slot the connection belongs to (its id without the restart count)."""
    inflight_batches: int
    latency_s: float
    """The balancer's latency EWMA for it (the fleet median while it has none)."""
    ejection: EjectionRecord
    credits: int | None = None
    """Batch slots the worker granted this front end and it has not used (None: no credits)."""
    high_water: int = 0
    """The most batches the worker held at once, from all its front ends (1 running + 1 staged: 2)."""

    @classmethod
    def of(cls, w: WorkerConnection, latency_s: float, ejection: EjectionRecord) -> BatchWorkerDetail:
        """The connection's batch fields now, with the balancer's latency and the ejection record."""
        return cls(w.slot_id, len(w.inflight), latency_s, ejection, w.credits, w.high_water)
