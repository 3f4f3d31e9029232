"""The batch fleet's simulated devices: each one a front end's own, or one shared by every front end.

`SimDevice` is one device and its worker process serving one front end: the writer of that front end's
`WorkerConnection`; a batch sent to it runs for the profile's cost (one at a time, the staged one after).

`SharedBatchDevice` serves every front end, as `inferd worker --connect a,b,...` does: each front end has
its own `WorkerConnection` to it, whose writer is that front end's link (`BatchLink`), and the device runs
inferd's own credit ledger (worker/credits.py) as the worker does (worker/main.py `_grant`): a batch is
sent only against a slot the ledger granted, so the device holds at most 1 running + 1 staged batch in
total, whichever front ends sent them. The front ends' Demand frames (the runtime's own report,
kinds/batch/credit_demand.py) are decoded off the links and go to the ledger; its Credit grants reach each
front end's connection (`on_credit`) at the same virtual instant, after the event that caused them, as
messages read in a later turn of the front end's event loop. Batches run in the order received; a closed
link's batches that have not started are dropped, the one running finishes (and is counted) unread.
A killed device is lost to every front end; a lost front end closes only its own links.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from inferd.clock import FakeClock
from inferd.config import ModelConfig
from inferd.fleetsim.events import EventQueue
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.wire import protocol as p
from inferd.wire.connection import Batch, WorkerConnection
from inferd.worker.credits import CreditLedger
from inferd.worker.fronts import FrontLink, take_batch, tell_credits

HEADER = 4
"""A frame's length prefix (protocol.encode_frame)."""


class SimFrontend(Protocol):
    index: int
    rt: ModelRuntime
    devices: list[Any]
    lost: bool


class Fleet(Protocol):
    clock: FakeClock
    events: EventQueue
    model: ModelConfig

    def cost(self, n: int) -> float: ...
    def finish(self, device: SimDevice, batch_id: int, cost: float) -> None: ...
    def dispatch(self, fe: Any) -> None: ...
    def deliver(self, fe: Any, conn: WorkerConnection, batch: Batch, cost: float) -> None: ...


class SimDevice:
    """One device and its worker process: the writer of its WorkerConnection."""

    def __init__(self, fleet: Fleet, frontend: Any, worker_id: str, slowdown: float = 1.0) -> None:
        self.fleet = fleet
        self.frontend = frontend
        self.worker_id = worker_id
        self.slowdown = slowdown
        self.dead = False
        self.draining = False
        self.free_at = 0.0
        self.scheduled: set[int] = set()
        self.conn = WorkerConnection(worker_id, fleet.model.name, 0, "sim", self)  # type: ignore[arg-type]
        self.conn.version = fleet.model.version
        self.transport = self

    # the StreamWriter surface WorkerConnection uses
    def write(self, data: bytes) -> None:
        fleet = self.fleet
        now = fleet.clock.now()
        for batch_id, batch in self.conn.inflight.items():
            if batch_id in self.scheduled:
                continue
            self.scheduled.add(batch_id)
            cost = fleet.cost(len(batch.items)) * self.slowdown
            start = max(now, self.free_at)
            self.free_at = start + cost
            fleet.events.at(self.free_at, fleet.finish, self, batch_id, cost)

    def is_closing(self) -> bool:
        return self.dead

    def close(self) -> None:
        self.dead = True

    def abort(self) -> None:
        self.dead = True


class BatchLink(FrontLink):
    """One shared device's link to one front end, both ways: the writer of that front end's
    WorkerConnection (its RunBatch and Demand frames to the worker) and the FrontLink the worker sends
    that front end's Credit grants on. Listed in the front end's `devices`."""

    draining = False

    def __init__(self, device: SharedBatchDevice, frontend: SimFrontend) -> None:
        super().__init__(frontend.index, f"frontend-{frontend.index}", self)  # type: ignore[arg-type]
        self.credits = True
        self.device = device
        self.frontend = frontend
        self.transport = self
        model = device.fleet.model
        self.conn = WorkerConnection(device.worker_id, model.name, 0, "sim", self, credits=0)  # type: ignore[arg-type]
        self.conn.version = model.version
        self.conn.zone = device.zone  # its Hello's
        self.batches = 0
        """Batches of this front end the device finished."""

    @property
    def dead(self) -> bool:
        return self.closed or self.device.dead

    # the StreamWriter surface WorkerConnection uses: this front end's frames to the worker
    def write(self, data: bytes) -> None:
        if self.dead:
            return
        msg = p.decode_message(memoryview(data)[HEADER:])
        if isinstance(msg, p.RunBatch):
            self.device.receive(self, msg.batch_id, len(msg.items))
        elif isinstance(msg, p.Demand):
            self.device.ledger.report(self.index, msg.queued, msg.oldest_age_s, msg.returned)
            self.device.grant()

    def is_closing(self) -> bool:
        return self.dead

    def close(self) -> None:
        """The front end closed the connection (it lost the worker): the worker drops the link."""
        if not self.dead:
            self.device.close(self)

    def abort(self) -> None:
        self.close()

    # the worker's side (FrontLink.send): a Credit reaches the front end's connection after this event
    def send(self, msg: p.Message) -> None:
        if not self.dead and isinstance(msg, p.Credit):
            fleet = self.device.fleet
            fleet.events.at(fleet.clock.now(), self._credit, msg)

    def _credit(self, msg: p.Credit) -> None:
        if self.dead:
            return
        fleet = self.device.fleet
        self.conn.on_credit(msg, fleet.clock.now())
        fleet.dispatch(self.frontend)  # the runtime's on_message: the dispatcher may use the slots


class SharedBatchDevice:
    """One device and its worker process, serving every live front end through one BatchLink each."""

    def __init__(
        self,
        fleet: Fleet,
        worker_id: str,
        frontends: list[SimFrontend],
        slowdown: float = 1.0,
        zone: str | None = None,
    ) -> None:
        self.fleet = fleet
        self.worker_id = worker_id
        self.slowdown = slowdown
        self.zone = zone
        self.dead = False
        self.ledger = CreditLedger(fleet.clock)
        """inferd's own grantor: 1 running + 1 staged batch in total, across the front ends."""
        self.held: deque[tuple[BatchLink, int, int]] = deque()
        """Batches received and not finished, in order: (link, batch id, items); the first one runs."""
        self.most_held = 0
        """The most batches held at once, counted here (apart from the ledger)."""
        self.links: dict[int, BatchLink] = {}
        for fe in frontends:
            link = BatchLink(self, fe)
            self.links[fe.index] = link
            self.ledger.join(fe.index)
        self.all_links = tuple(self.links.values())
        """Every link it had, closed ones included (the statistics)."""

    def join(self) -> None:
        """Each front end gets the worker, then the worker's first grants (or state) come."""
        for link in self.links.values():
            link.frontend.devices.append(link)
            link.frontend.rt.add_worker(link.conn)
        self.grant()
        for link in self.links.values():
            self.fleet.dispatch(link.frontend)

    def add(self, fe: SimFrontend) -> None:
        """A front end started after the device (a zone healed): the worker joins it as the others."""
        link = BatchLink(self, fe)
        self.links[fe.index] = link
        self.all_links += (link,)
        self.ledger.join(fe.index)
        fe.devices.append(link)
        fe.rt.add_worker(link.conn)
        self.grant()
        self.fleet.dispatch(fe)

    def grant(self) -> None:
        """As the worker's `_grant`: hand out free slots, and tell front ends holding slots when the
        worker's state changed (the worker's own `tell_credits`)."""
        tell_credits(self.ledger, self.links)

    # ---- the device: one batch at a time, in the order received --------------------------------------
    def receive(self, link: BatchLink, batch_id: int, items: int) -> None:
        take_batch(self.ledger, link, items)
        self.held.append((link, batch_id, items))
        self.most_held = max(self.most_held, len(self.held))
        self.grant()
        if len(self.held) == 1:
            self._start()

    def _start(self) -> None:
        """Run the next held batch; a closed link's batch that has not started is dropped."""
        while self.held:
            link, batch_id, items = self.held[0]
            if not link.closed:
                cost = self.fleet.cost(items) * self.slowdown
                self.fleet.events.at(self.fleet.clock.now() + cost, self._finish, link, batch_id, cost)
                return
            self.held.popleft()
            self.ledger.finished()
            self.grant()

    def _finish(self, link: BatchLink, batch_id: int, cost: float) -> None:
        if self.dead:
            return
        self.held.popleft()
        self.ledger.finished()
        self.grant()
        self._start()
        batch = link.conn.inflight.get(batch_id)
        if link.closed or batch is None:
            return
        link.batches += 1
        self.fleet.deliver(link.frontend, link.conn, batch, cost)

    # ---- failures ----------------------------------------------------------------------------------
    def kill(self, reason: str) -> None:
        """The worker process dies: every front end loses it."""
        self.dead = True
        for link in self.links.values():
            fe = link.frontend
            fe.devices.remove(link)
            fe.rt.on_worker_lost(link.conn, reason)
            self.fleet.dispatch(fe)
        self.links.clear()

    def close(self, link: BatchLink) -> None:
        """The front end is gone: the worker drops its link (as `_detach`), the others run on."""
        link.closed = True
        self.links.pop(link.index, None)
        self.ledger.leave(link.index)
        self.grant()
