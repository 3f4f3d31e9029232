"""One simulated LLM device: inferd's engine (kinds/llm/engine.py `LLMEngine`: its receive / apply / post steps)
around inferd's own continuous-batching scheduler and KV cache, driven on the fleet's virtual clock.

`DeviceLoop` is the engine loop (receive -> schedule -> run (the cost model) -> deliver -> idle); what
differs is who the device talks to:
- `SimLLMDevice`: one front end (the fleet's partitioned mode): it is the writer of that front end's
  WorkerConnection, and each step's StepDeltas go straight into that runtime's `on_message`;
- `llm_links.SharedLLMDevice`: every front end, as `inferd worker --connect a,b,...` serves them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from inferd.clock import FakeClock
from inferd.fleetsim.events import EventQueue
from inferd.kinds.llm.engine import LLMEngine, new_scheduler
from inferd.kinds.llm.model import LLMModel, LLMRequest
from inferd.kinds.llm.plan import SchedulerConfig, SeqOutput, StepPlan
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection

_TOKEN = SeqOutput(token=0)
HEADER = 4
"""Bytes of a frame's length prefix (wire/protocol.py encode_frame)."""


class Fleet(Protocol):
    """What a device needs of its fleet (llm_fleet.LLMFleet)."""

    clock: FakeClock
    events: EventQueue
    model: LLMModel
    scheduler_config: SchedulerConfig

    @property
    def model_name(self) -> str: ...

    def step_cost(self, plan: StepPlan) -> float: ...

    def observe(self, msg: p.StepDeltas, live: dict[str, Any]) -> None: ...


class CostModelLLM(LLMModel):
    """The device's model: one token per sampling chunk, no compute; the fleet charges the step cost."""

    def run_step(self, plan: StepPlan, requests: Mapping[str, LLMRequest]) -> dict[str, SeqOutput]:
        return {c.seq_id: _TOKEN for c in plan.chunks if c.samples}


class DeviceLoop:
    """The engine loop on the virtual clock; `send` is the engine's send (each step's StepDeltas)."""

    def __init__(self, fleet: Fleet, worker_id: str, send: Callable[[p.Message], None]) -> None:
        self.fleet = fleet
        self.worker_id = worker_id
        self.dead = False
        self.busy = False
        scheduler = new_scheduler(fleet.scheduler_config, fleet.clock)
        self.scheduler = scheduler
        self.engine = LLMEngine(fleet.model, scheduler, send, _no_flush, None)  # type: ignore[arg-type]

    def connections(self) -> list[tuple[LLMRuntime, WorkerConnection]]:
        """Each front end's connection to this device."""
        raise NotImplementedError

    def kill(self, reason: str) -> None:
        """The worker process is gone: every front end it served loses its connection."""
        self.dead = True
        for runtime, conn in self.connections():
            runtime.on_worker_lost(conn, reason)

    def submit(self, msg: p.AddSequence | p.AbortSequence) -> None:
        self.engine.submit(msg)
        if not self.busy:
            self.busy = True
            self.fleet.events.at(self.fleet.clock.now(), self.step)

    # the engine loop: receive -> schedule -> run (the cost model) -> deliver -> idle
    def step(self) -> None:
        if self.dead:
            return
        engine = self.engine
        notes = engine.receive()
        if not self.scheduler.has_work():
            if notes:
                engine.post(notes, 0.0)
            self.busy = False
            return
        plan = self.scheduler.schedule()
        outputs = engine.model.run_step(plan, engine.requests)
        cost = self.fleet.step_cost(plan)
        self.fleet.events.at(self.fleet.clock.now() + cost, self.finish, plan, outputs, notes, cost)

    def finish(self, plan: StepPlan, outputs: dict, notes: list[p.SeqDelta], cost: float) -> None:
        if self.dead:
            return
        self.engine.post_step(plan, outputs, notes, cost)
        self.step()


class SimLLMDevice(DeviceLoop):
    """A device of one front end: the writer of that front end's WorkerConnection."""

    def __init__(self, fleet: Fleet, worker_id: str, runtime: LLMRuntime, live: dict[str, Any]) -> None:
        super().__init__(fleet, worker_id, self.receive_step)
        self.runtime = runtime
        self.live = live
        """The fleet's tracking of this front end's streams."""
        self.conn = WorkerConnection(worker_id, fleet.model_name, 0, "sim", self)  # type: ignore[arg-type]
        self.transport = self

    def connections(self) -> list[tuple[LLMRuntime, WorkerConnection]]:
        return [(self.runtime, self.conn)]

    # the StreamWriter surface WorkerConnection uses: the runtime's frames to this worker
    def write(self, data: bytes) -> None:
        msg = p.decode_message(memoryview(data)[HEADER:])
        live = self.runtime.placement.live.get(getattr(msg, "seq_id", ""))
        if live is not None:  # the front end's own id object: every lookup per token is by identity
            msg.seq_id = live.stream.seq_id  # type: ignore[union-attr]
        self.submit(msg)  # type: ignore[arg-type]

    def is_closing(self) -> bool:
        return self.dead

    def close(self) -> None:
        self.dead = True

    def abort(self) -> None:
        self.dead = True

    def receive_step(self, msg: p.Message) -> None:
        """The engine's StepDeltas, straight into the front end (the socket is not simulated)."""
        if not self.dead and isinstance(msg, p.StepDeltas):
            self.runtime.on_message(self.conn, msg)
            self.fleet.observe(msg, self.live)


async def _no_flush() -> None:
    return None
