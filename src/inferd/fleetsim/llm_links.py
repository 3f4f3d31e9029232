"""A simulated LLM device shared by every front end, as `inferd worker --connect a,b,...` serves them.

The real worker (worker/main.py) joins each front end over a link of its own and runs one engine for all
of them; inferd's own `SequenceOwners` (worker/fronts.py) makes sequence ids unique per link on the way
in ('2/llm-7'), splits each step's StepDeltas by owner on the way out, and aborts a link's sequences when
the link goes (`release`). Here the same object does the same, between the same engine and each front
end's own `LLMRuntime`:
- each front end has its own WorkerConnection to the device, whose writer is that link (`SimLink`): its
  AddSequence / AbortSequence frames are decoded and go through `SequenceOwners.inbound` to the engine;
- the engine's send is `SequenceOwners.send`, which hands each link that front end's share of the step
  (a StepDeltas of its own, under the ids that front end knows); the link gives it to its runtime's
  `on_message` (the socket is not simulated) and to the fleet's stream tracking of that front end;
- a front end that closes its link loses the worker (its streams fail over) and the engine aborts that
  front end's sequences; the others run on. A killed device is dead for every front end.

Each front end's placement counts only what it placed on the device, so each sees a part of its load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inferd.fleetsim.llm_device import HEADER, DeviceLoop, Fleet
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection
from inferd.worker.fronts import FrontLink, SequenceOwners


class SimLink(FrontLink):
    """One device's link to one front end, both ways: the writer of that front end's WorkerConnection
    (frames to the worker) and the FrontLink the worker's SequenceOwners sends that front end's deltas on."""

    def __init__(
        self, index: int, device: SharedLLMDevice, runtime: LLMRuntime, live: dict[str, Any]
    ) -> None:
        super().__init__(index, f"frontend-{index}", self)  # type: ignore[arg-type]
        self.device = device
        self.runtime = runtime
        self.live = live
        """The fleet's tracking of this front end's streams."""
        self.added = 0
        """Sequences this front end placed on the device (failover moves included)."""
        self.transport = self
        model = device.fleet.model_name
        self.conn = WorkerConnection(device.worker_id, model, 0, "sim", self)  # type: ignore[arg-type]

    # the StreamWriter surface WorkerConnection uses: this front end's frames to the worker
    def write(self, data: bytes) -> None:
        if self.closed or self.device.dead:
            return
        msg = p.decode_message(memoryview(data)[HEADER:])
        if isinstance(msg, (p.AddSequence, p.AbortSequence)):
            self.added += isinstance(msg, p.AddSequence)
            self.device.submit(self.device.owners.inbound(self, msg))

    def is_closing(self) -> bool:
        return self.closed or self.device.dead

    def close(self) -> None:
        """The front end closed the connection: it loses the worker, the worker drops the link."""
        if self.closed or self.device.dead:
            return
        self.closed = True
        self.device.detach(self)
        self.runtime.on_worker_lost(self.conn, "connection closed")

    def abort(self) -> None:
        self.close()

    # the worker's side (FrontLink.send): this front end's share of a step, straight into its runtime
    def send(self, msg: p.Message) -> None:
        if not self.closed and not self.device.dead and isinstance(msg, p.StepDeltas):
            self.runtime.on_message(self.conn, msg)
            self.device.fleet.observe(msg, self.live)


class SharedLLMDevice(DeviceLoop):
    """One engine serving every front end through SequenceOwners, one SimLink per front end."""

    def __init__(
        self, fleet: Fleet, worker_id: str, runtimes: Sequence[LLMRuntime], lives: Sequence[dict[str, Any]]
    ) -> None:
        self.links: dict[int, SimLink] = {}
        """The front ends joined, by index (a closed link leaves)."""
        self.owners = SequenceOwners(lambda: self.links)  # type: ignore[arg-type, return-value]
        super().__init__(fleet, worker_id, self.owners.send)
        for i, (runtime, live) in enumerate(zip(runtimes, lives, strict=True)):
            self.links[i] = SimLink(i, self, runtime, live)
        self.all_links = tuple(self.links.values())
        """Every link it had, closed ones included (the statistics)."""

    def connections(self) -> list[tuple[LLMRuntime, WorkerConnection]]:
        return [(link.runtime, link.conn) for link in self.links.values()]

    def detach(self, link: SimLink) -> None:
        """As the worker's `_detach`: the link leaves and its live sequences are aborted."""
        self.links.pop(link.index, None)
        for abort in self.owners.release(link.index):
            self.submit(abort)
