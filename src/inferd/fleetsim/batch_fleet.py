"""A fleet of batch-model devices behind one or more front ends, simulated on a virtual clock.

Each front end is inferd's own `ModelRuntime` (kinds/batch/dispatcher.py), built as the server builds it:
its queue, admission, batch policy, mix policy, power-of-two-choices balancer, outlier ejector,
hedging watchdog and recovery run unchanged. Only the edges are simulated:
- a device is the writer of a real `WorkerConnection`: a batch sent to it runs for the profile's cost
  (one at a time, the staged one after), then the runtime gets the worker's `BatchDone`;
- the front end's own CPU is a FIFO server taking `frontend_s` per request, and every answer gets the
  profile's `overhead_s` (HTTP and IPC);
- the supervisor brings a killed device back after `restart_s`;
- failures (devices killed or slowed, a front end or a zone lost) come at their times (failures.py).
With zones (fleetsim/zones.py) each front end, device and client is in one, and each front end's runtime
routes with the server's own `LocalityPolicy`.

Front ends split the arrivals round-robin, as a connection-balancing load balancer would. Every device
serves every front end under inferd's own credit ledger (batch_devices.py), as the workers of `inferd
serve --frontends N` and `inferd worker --connect a,b,...` do: each front end keeps its own queue and
batch policy and sends a batch only against a slot the worker granted it. With `shared_devices=False`
each has its own share instead (a front end lost fails what it held; its devices join the others). One
front end has the devices to itself (a worker serving it alone grants it every free slot unasked).
`ModelRuntime.enqueue` creates asyncio futures, so `run` is called inside a running event loop
(`simulate` does that); nothing awaits them and no task runs.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import numpy as np

from inferd.clock import FakeClock
from inferd.config import ModelConfig
from inferd.config.autoscaler import AutoscalerConfig
from inferd.errors import Overloaded, ServingError
from inferd.fleetsim.batch_devices import SharedBatchDevice, SimDevice
from inferd.fleetsim.events import EventQueue
from inferd.fleetsim.failures import Failure, inject
from inferd.fleetsim.profiles import BatchProfile
from inferd.fleetsim.report import Outcome, SimReport
from inferd.fleetsim.scaling import SimScaling
from inferd.fleetsim.tenants import SimTenant, SimTenants
from inferd.fleetsim.zones import SimZones
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.kinds.batch.queue import QueuedItem
from inferd.observability.metrics import Metrics
from inferd.routing.fairness import INTERACTIVE, NO_TENANT
from inferd.routing.locality import LocalityPolicy
from inferd.routing.retry import RetryBudget
from inferd.wire import protocol as p
from inferd.wire.connection import Batch, WorkerConnection

WATCHDOG_EVERY_S = 0.1
"""How often the runtime's watchdog runs (hedges, hung workers), as the server's does."""
OUTPUT = "0" * 32
DISPATCH_QUANTUM_S = 0.001
"""The default time resolution of arrivals' dispatch: arrivals within this much of each other share one
dispatch pass, as requests read in one turn of the server's event loop do; completions and the batch
policy's own wake-ups dispatch at once."""


@dataclass(slots=True)
class FleetSpec:
    model: ModelConfig
    profile: BatchProfile
    devices: int
    arrivals: np.ndarray
    """Intended request times, seconds from the start."""
    frontends: int = 1
    warmup_s: float = 0.0
    timeout_s: float | None = None
    """The client's deadline per request (not sent to the server): later answers count as timeouts."""
    failures: list[Failure] = field(default_factory=list)
    restart_s: float = 2.0
    seed: int = 0
    autoscale: AutoscalerConfig | None = None
    """Drive the server's autoscaler (fleetsim/scaling.py); one front end."""
    tenants: list[SimTenant] = field(default_factory=list)
    """Who sends the arrivals, with their quotas and weights (fleetsim/tenants.py); none: no tenants."""
    dispatch_quantum_s: float = DISPATCH_QUANTUM_S
    shared_devices: bool = True
    """With several front ends: every device serves every front end, under its credit ledger
    (fleetsim/batch_devices.py); False: device d is front end d % frontends' alone."""
    zones: int = 0
    """Front ends, devices and clients spread over this many zones (fleetsim/zones.py); 0: no zones."""
    overprovisioning: float = 1.4
    """With zones: each front end's `[cluster] overprovisioning` (routing/locality.py)."""

    @property
    def shares_devices(self) -> bool:
        return self.shared_devices and self.frontends > 1


class Frontend:
    def __init__(self, fleet: BatchFleet, index: int, zone: str | None = None) -> None:
        self.index = index
        self.zone = zone
        over = fleet.spec.overprovisioning
        self.rt = ModelRuntime(
            fleet.model,
            fleet.clock,
            fleet.metrics.for_model(fleet.model.name),
            RetryBudget(fleet.clock, 0.1, 10.0),
            kill_worker=fleet.kill_hung,
            locality=None if zone is None else LocalityPolicy(fleet.clock, zone, overprovisioning=over),
        )
        self.free_at = 0.0
        self.wake_at: float | None = None
        self.pass_pending = False
        self.devices: list[SimDevice] = []
        """Its devices; with shared devices, its links to them (batch_devices.BatchLink)."""
        self.lost = False


class BatchFleet:
    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.model = spec.model
        self.profile = spec.profile
        self.clock = FakeClock(0.0)
        self.events = EventQueue(self.clock)
        self.metrics = Metrics()
        self.rng = np.random.default_rng(spec.seed)
        self._noise = self.rng.standard_normal(1 << 16)
        self._noise_at = 0
        n = spec.arrivals.size
        self.done_at = np.full(n, math.nan)
        self.outcome = np.zeros(n, dtype=np.int8)
        self.items: list[QueuedItem | None] = [None] * n
        self.owner = np.full(n, -1, dtype=np.int32)
        self.batches = 0
        self.batched_squares = 0
        self.full_batch = (
            0
            if spec.model.preferred_batch_sizes or spec.model.batching == "slo"
            else spec.model.max_batch_size
        )
        """Below this many queued items an arrival cannot make the batch policy cut sooner than the
        wake-up it asked for (with preferred sizes or SLO batching it can: every arrival dispatches)."""
        self.batched_items = 0
        self.restarts = 0
        self.zones = None if not spec.zones else SimZones(spec.zones, n)
        if self.zones is not None and not (spec.shares_devices and spec.frontends >= spec.zones):
            raise ValueError("zones need a front end in each (--frontends >= --zones) and shared devices")
        zone_of = (lambda i: None) if self.zones is None else self.zones.frontend_zone
        self.frontends = [Frontend(self, i, zone_of(i)) for i in range(spec.frontends)]
        self.shared: list[SharedBatchDevice] | None = [] if spec.shares_devices else None
        """Every shared device started (killed ones included); None: each front end has its own."""
        for d in range(spec.devices):
            self.start_device(self.frontends[d % spec.frontends], f"{self.model.name}-{d}.0")
        if spec.autoscale is not None and spec.frontends != 1:
            raise ValueError("the simulated autoscaler runs with one front end")
        self.scaling = None if spec.autoscale is None else SimScaling(self, spec.autoscale)
        self.tenants = SimTenants(spec.tenants, n, spec.seed) if spec.tenants else None

    # ---- the device cost model --------------------------------------------------------------------------
    def cost(self, n: int) -> float:
        cost = self.profile.batch_s(n)
        if self.profile.jitter_cv:
            self._noise_at = (self._noise_at + 1) & 0xFFFF
            cost *= max(0.05, 1.0 + self.profile.jitter_cv * self._noise[self._noise_at])
        return cost

    # ---- devices ---------------------------------------------------------------------------------------
    def start_device(self, fe: Frontend, worker_id: str, slowdown: float = 1.0) -> None:
        if self.shared is not None:  # it joins every live front end
            zone = None if self.zones is None else self.zones.slot_zone(worker_id.rpartition(".")[0])
            live = [f for f in self.frontends if not f.lost]
            shared = SharedBatchDevice(self, worker_id, live, slowdown, zone)
            self.shared.append(shared)
            return shared.join()
        device = SimDevice(self, fe, worker_id, slowdown)
        fe.devices.append(device)
        fe.rt.add_worker(device.conn)
        self.dispatch(fe)

    def kill(self, device: SimDevice | SharedBatchDevice, reason: str) -> None:
        """The device's process dies: its connection is lost, the supervisor restarts it later."""
        if device.dead:
            return
        if isinstance(device, SharedBatchDevice):
            device.kill(reason)  # every front end loses it
        else:
            device.dead = True
            device.frontend.devices.remove(device)
            device.frontend.rt.on_worker_lost(device.conn, reason)
        slot, _, generation = device.worker_id.rpartition(".")
        self.events.at(
            self.clock.now() + self.spec.restart_s, self.restart, slot, int(generation) + 1, device.slowdown
        )
        if isinstance(device, SimDevice):
            self.dispatch(device.frontend)

    def drain_one(self, fe: Frontend) -> None:
        """Scale down by one: the least loaded device takes no new batch and leaves once it is idle."""
        live = [d for d in fe.devices if not d.draining and not d.dead]
        if not live:
            return
        device = min(live, key=lambda d: len(d.conn.inflight))
        device.draining = True
        fe.rt.drain_worker(device.conn)
        if not device.conn.inflight:
            self.retire(device)

    def retire(self, device: SimDevice) -> None:
        """A drained device's process exits: its connection closes with nothing in flight."""
        device.dead = True
        device.frontend.devices.remove(device)
        device.frontend.rt.on_worker_lost(device.conn, "drained")

    def kill_hung(self, conn: WorkerConnection) -> None:
        """A front end's watchdog killed the worker: a shared one is gone for every front end."""
        for fe in self.frontends:
            for device in fe.devices:
                if device.conn is conn:
                    hung = device if self.shared is None else device.device
                    self.events.at(self.clock.now(), self.kill, hung, "killed by the watchdog")
                    return

    def restart(self, slot: str, generation: int, slowdown: float) -> None:
        live = [fe for fe in self.frontends if not fe.lost]
        if not live or (self.zones is not None and self.zones.wait_for_heal(slot, generation, slowdown)):
            return
        self.restarts += 1
        fe = min(live, key=lambda f: len(f.devices))
        self.start_device(fe, f"{slot}.{generation}", slowdown)

    def finish(self, device: SimDevice, batch_id: int, cost: float) -> None:
        if device.dead:
            return
        batch = device.conn.inflight.get(batch_id)
        device.scheduled.discard(batch_id)
        if batch is None:
            return
        self.deliver(device.frontend, device.conn, batch, cost, device)

    def deliver(
        self, fe: Frontend, conn: WorkerConnection, batch: Batch, cost: float, device: SimDevice | None = None
    ) -> None:
        """The worker's BatchDone reaches the front end's runtime; its answers reach the clients."""
        items = batch.items
        fe.rt.on_batch_done(conn, p.BatchDone(batch.batch_id, cost, [OUTPUT] * len(items)))
        self.batches += 1
        self.batched_items += len(items)
        self.batched_squares += len(items) * len(items)
        now = self.clock.now()
        if device is not None and device.draining and not conn.inflight:
            self.retire(device)
        for item in items:
            rid = item.payload
            reply = item.reply
            if self.outcome[rid] == Outcome.PENDING and reply.done() and reply.exception() is None:
                self.done_at[rid] = now
                self.outcome[rid] = Outcome.OK
                self.items[rid] = None
                if self.tenants is not None:
                    self.tenants.release(rid, now)
                if self.zones is not None:
                    self.zones.answered(rid, conn.zone)
        self.dispatch(fe)

    # ---- front ends --------------------------------------------------------------------------------------
    def arrive(self, rid: int) -> None:
        live = [fe for fe in self.frontends if not fe.lost]
        if rid + 1 < self.spec.arrivals.size:
            self.events.at(float(self.spec.arrivals[rid + 1]), self.arrive, rid + 1)
        if not live:
            self.outcome[rid] = Outcome.FAILED
            return
        fe = live[rid % len(live)] if self.zones is None else self.zones.frontend_for(rid, live)
        now = self.clock.now()
        start = max(now, fe.free_at)
        fe.free_at = start + self.profile.frontend_s
        if fe.free_at > now + self.profile.frontend_s:  # the front end's CPU is behind: wait for it
            self.events.at(fe.free_at, self.admit, fe, rid)
        else:
            self.admit(fe, rid)

    def admit(self, fe: Frontend, rid: int) -> None:
        if fe.lost:
            self.outcome[rid] = Outcome.FAILED
            return
        share = NO_TENANT if self.tenants is None else self.tenants.admit(rid, self.clock.now())
        if share is None:  # the tenant's own quota: a 429 from the gateway, before the queue
            self.outcome[rid] = Outcome.LIMITED
            self.done_at[rid] = self.clock.now()
            return
        try:
            (item,) = fe.rt.enqueue([rid], None, INTERACTIVE, share)
        except ServingError as exc:
            self.outcome[rid] = Outcome.REJECTED if isinstance(exc, Overloaded) else Outcome.FAILED
            self.done_at[rid] = self.clock.now()
            return
        self.items[rid] = item
        self.owner[rid] = fe.index
        if self.zones is not None and fe.zone is not None:
            self.zones.admitted(rid, fe.zone)
        if fe.wake_at is not None and len(fe.rt.queue) < self.full_batch:
            return  # BatchPolicy cuts below a full batch only at its wake-up, which is already due
        if not fe.pass_pending:
            fe.pass_pending = True
            self.events.at(self.clock.now() + self.spec.dispatch_quantum_s, self._pass, fe)

    def add_frontend(self, zone: str) -> Frontend:
        """A front end starts (a zone healed): every live device joins it."""
        fe = Frontend(self, len(self.frontends), zone)
        self.frontends.append(fe)
        for device in self.shared or ():
            if not device.dead:
                device.add(fe)
        return fe

    def dispatch(self, fe: Frontend) -> None:
        if fe.lost:
            return
        wake_at = fe.rt.dispatch_due()
        if self.shared is not None:
            fe.rt.report_demand()
        if wake_at is not None and (fe.wake_at is None or wake_at < fe.wake_at):
            fe.wake_at = wake_at
            self.events.at(wake_at, self._wake, fe)

    def _pass(self, fe: Frontend) -> None:
        fe.pass_pending = False
        self.dispatch(fe)

    def _wake(self, fe: Frontend) -> None:
        fe.wake_at = None
        self.dispatch(fe)

    def watchdog(self) -> None:
        now = self.clock.now()
        for fe in self.frontends:
            if fe.lost:
                continue
            for device in fe.devices:
                device.conn.last_heartbeat = now
            fe.rt.check_workers()
            self.dispatch(fe)
        self.events.at(now + WATCHDOG_EVERY_S, self.watchdog)

    # ---- running -------------------------------------------------------------------------------------------
    def run(self) -> SimReport:
        spec = self.spec
        end = float(spec.arrivals[-1]) if spec.arrivals.size else 0.0
        if spec.arrivals.size:
            self.events.at(float(spec.arrivals[0]), self.arrive, 0)
        self.events.at(0.0, self.watchdog)
        if self.scaling is not None:
            self.events.at(self.scaling.interval_s, self.scaling.tick)
        for failure in spec.failures:
            self.events.at(failure.at_s, inject, self, failure)
        drain = 10.0 if spec.timeout_s is None else spec.timeout_s
        self.events.run_until(end + drain)
        self._settle_failures()
        return SimReport.build(self, end)

    @property
    def events_processed(self) -> int:
        return self.events.processed

    def _settle_failures(self) -> None:
        """Requests whose future holds an error (expired, worker died, retries exhausted) failed."""
        for rid, item in enumerate(self.items):
            if item is None or self.outcome[rid] != Outcome.PENDING:
                continue
            if item.reply.done():  # a displaced request (a tenant within its share took its place) is a 429
                refused = isinstance(item.reply.exception(), Overloaded)
                self.outcome[rid] = Outcome.REJECTED if refused else Outcome.FAILED


def simulate(spec: FleetSpec) -> SimReport:
    """Run the fleet inside a private event loop (the runtime creates futures; no task ever runs)."""

    async def main() -> SimReport:
        return BatchFleet(spec).run()

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
