"""A pool worker: one process, one device, many models loaded and unloaded on demand within a memory budget.

    python -m inferd.worker.main --pool NAME --connect unix:/run/inferd.sock [--token T]
    inferd worker --pool NAME --connect a:9000,b:9000

It joins every front end with a **pool link**: Hello(model="", pool=NAME) -> Welcome(pool_config_json: the
pool's `[pools.NAME]` settings, the first front end's binding). The front end then sends LoadModel /
UnloadModel (and Drain); the worker sends PoolState at once, on every change and with each heartbeat, and
LoadResult to every front end when a load ends. A pool link carries no batch: each model held is served by
its own model server, an ordinary worker of that model (worker/holdings.py).

SIGTERM, or a front end's Drain on a pool link, drains the worker: every pool link is told at once (Drain:
its front end sends no more loads here, and takes a load refused or given up from now on as not placed,
not as failed), every model server drains (its front ends answer after the last batch they sent) and
unloads, then each pool link gets the last PoolState and ends; the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import ssl
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from inferd.pools.residency import Limits
from inferd.wire import protocol as p
from inferd.wire.connection import model_link_id
from inferd.worker import memory
from inferd.worker.credits import Seat
from inferd.worker.device import Device
from inferd.worker.discovery import FrontEnd
from inferd.worker.fronts import FrontLink, give_up_when_silent
from inferd.worker.holdings import Holdings, ModelServer
from inferd.worker.joining import JOIN_TIMEOUT_S, FrontEnds, keep_joined
from inferd.worker.resolver import Resolver
from inferd.worker.signals import DRAIN_ANSWER_TIMEOUT_S
from inferd.worker.stuck import STUCK_AFTER_S

log = logging.getLogger("inferd.worker")

SWITCH_INTERVAL_S = 0.0005
"""The GIL's switch interval in a pool worker process (CPython's default is 5 ms). A load runs in its own
thread beside the batches of the models held, and wherever its code holds the GIL (sim's allocation, a
deserializer), the event loop back from each wait for I/O (a batch to receive, a result to send) waits
for the GIL up to the switch interval before it can force a turn: a few such waits per batch made a warm
batch tens of milliseconds late while a load ran. At 0.5 ms a wait costs little more than the piece of C
code the load thread is in."""


def settle_process() -> None:
    """A pool worker process's settings, before it serves: what the imports made leaves the collector's
    view (`gc.freeze`: the collection after each unload, `memory.give_back`, holds the GIL, and over every
    object of the process it took 10-20 ms per eviction, during which no model's batch moved), the
    GIL's switch interval is short (SWITCH_INTERVAL_S), and a model's large buffers leave resident
    memory as they are freed (`memory.return_large_frees`: a load's cost is measured there)."""
    memory.return_large_frees()
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def limits(pool_config_json: bytes) -> Limits:
    """The settings that bind one worker, from the Welcome's pool config (`[pools.NAME]` as JSON)."""
    raw = msgspec.json.decode(pool_config_json, type=dict)
    cap = raw.get("max_loaded_models")
    return Limits(
        budget_mb=float(raw["memory_budget_mb"]),
        max_loaded_models=None if cap is None else int(cap),
        max_concurrent_loads=int(raw.get("max_concurrent_loads", 1)),
        min_resident_s=float(raw.get("min_resident_s", 5.0)),
    )


class PoolWorker:
    def __init__(
        self, address: str, pool: str, token: str, worker_id: str, reconnect: bool = False,
        model_repo: Path | None = None, tls_context: ssl.SSLContext | None = None,
        stuck_after_s: float = STUCK_AFTER_S, zone: str | None = None, resolver: Resolver | None = None,
        model_server: Callable[..., ModelServer] | None = None,
    ) -> None:
        assert model_server is not None, "worker/main.py passes Worker (`model_server`: its class)"
        self.connect = address
        self.pool = pool
        self.token = token
        self.worker_id = worker_id
        """Its pool links' id; each model server joins as `<id>/<model>:<version>` (wire/connection.py
        `model_link_id`): a worker of its own in the front end's directory."""
        self.reconnect = reconnect
        self.tls = tls_context
        self.stuck_after_s = stuck_after_s
        self.zone = zone
        self.resolver = resolver or Resolver()
        self._model_server = model_server
        self.holdings = Holdings(worker_id, model_repo, self._tell, self._new_server)
        self.configured = False
        self.links: dict[int, FrontLink] = {}
        """Pool links joined, by index."""
        self._left: dict[int, asyncio.Event] = {}
        self.draining = False
        self.drain_asked = asyncio.Event()
        self._finished = asyncio.Event()
        """Drained: every model server has stopped and its model is unloaded."""

    def _new_server(
        self, model: str, version: int, device: Device, seat: Seat, tell_credits: Callable[[], None]
    ) -> ModelServer:
        """A model server: a worker of that model joining every front end, its device holding the model,
        its batch slots a seat on the ledger of the device the pool worker's models share."""
        return self._model_server(
            self.connect, model, self.token, model_link_id(self.worker_id, model, version), True,
            device.model_repo, version, self.tls,
            self.stuck_after_s, self.zone, self.resolver, device=device, pool=self.pool, seat=seat,
            tell_credits=tell_credits,
        )

    async def run(self) -> int:
        """Serve the pool until drained (SIGTERM, or a front end's Drain), or (a local worker) until the
        front end that runs it goes. Returns the exit code."""
        async with asyncio.TaskGroup() as tg:
            planner = tg.create_task(self.holdings.plan(tg))
            finishing = tg.create_task(self._finish())
            fronts = FrontEnds(self, self.connect, self.resolver, tg)
            outcome = await fronts.run()
            if outcome != "drained":  # its front end is gone: stop serving at once
                for task in self.holdings.tasks:
                    task.cancel()
            self.drain()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_ANSWER_TIMEOUT_S + self.stuck_after_s):
                    await self._finished.wait()
            for task in (*self.holdings.tasks, planner, finishing):
                task.cancel()
            fronts.cancel()
        return {"drained": 0, "lost": 0, "left": 0}.get(outcome, 2)

    def drain(self, signalled: bool = False) -> bool:
        """Take no new load, drain every model server (each finishes what its front ends sent), then end the
        pool links (SIGTERM, or a front end's Drain on a pool link)."""
        if not self.draining:
            log.info("pool worker %s draining", self.worker_id)
            for link in self.links.values():  # first: the loads it refuses or gives up are not failures
                link.send(p.Drain())
        self.draining = True
        self.drain_asked.set()
        self.holdings.close()
        return True

    async def _finish(self) -> None:
        await self.drain_asked.wait()
        await self.holdings.emptied()
        self._finished.set()

    # ---- pool links ----------------------------------------------------------------------------------
    async def link(self, index: int, front: FrontEnd, reconnect: bool) -> str:
        left = self._left.setdefault(index, asyncio.Event())
        try:
            return await keep_joined(self, front, reconnect, left, lambda: self._session(index, front))
        finally:
            del self._left[index]

    def leave(self, index: int) -> None:
        """Its front end is no longer named: the pool link ends (the model servers leave it on their own)."""
        if index in self._left:
            self._left[index].set()

    def cut_unanswered(self, index: int) -> None:
        link = self.links.get(index)
        if link is not None:
            link.cut_off("it was left and its pool link is still open")

    async def _session(self, index: int, front: FrontEnd) -> str:
        link: FrontLink | None = None
        try:
            async with asyncio.timeout(JOIN_TIMEOUT_S):
                reader, writer = await p.open_connection(front.address, self.tls, front.server_hostname)
                lifeline = index == 0 and not self.reconnect
                link = FrontLink.joined(index, str(front), writer, self.stuck_after_s, lifeline)
                link.send(p.Hello(self.worker_id, "", os.getpid(), socket.gethostname(), self.token,
                                  zone=self.zone, pool=self.pool))
                welcome = await p.read_message(reader)
            if not isinstance(welcome, p.Welcome) or not welcome.accepted or not welcome.pool_config_json:
                reason = welcome.reason if isinstance(welcome, p.Welcome) else type(welcome).__name__
                log.error("pool worker %s: the front end at %s refused its pool link: %s", self.worker_id,
                          front, reason or "its Welcome carries no pool settings")
                return "refused"
            give_up_when_silent(writer, welcome.silence_timeout_s)
            if not self.configured:  # every front end serves the same pools: the first one's settings bind
                self.configured = True
                self.holdings.configure(limits(welcome.pool_config_json))
                log.info("pool worker %s joined pool %s: %s", self.worker_id, self.pool,
                         self.holdings.residency.limits)
            return await self._serve(link, reader, welcome.heartbeat_s)
        finally:
            if link is not None:
                link.close()

    async def _serve(self, link: FrontLink, reader: asyncio.StreamReader, heartbeat_s: float) -> str:
        self.links[link.index] = link
        link.send(self.holdings.state())
        if self.draining:  # it joined while the worker drains: no load for it
            link.send(p.Drain())
        try:
            async with asyncio.TaskGroup() as tg:
                receiving = tg.create_task(self._receive(link, reader))
                beating = tg.create_task(self._heartbeat(link, heartbeat_s))
                finished = tg.create_task(self._finished.wait())
                await asyncio.wait({receiving, beating, finished}, return_when=asyncio.FIRST_COMPLETED)
                outcome = next((t.result() for t in (receiving, beating) if t.done()), "drained")
                for task in (receiving, beating, finished):
                    task.cancel()
        finally:
            self.links.pop(link.index, None)
        if outcome == "drained":  # the last state (nothing held); its Drain went when draining began
            link.send(self.holdings.state())
        await link.finish(self.stuck_after_s)
        return outcome

    async def _receive(self, link: FrontLink, reader: asyncio.StreamReader) -> str:
        while True:
            try:
                msg = await p.read_message(reader)
            except p.ConnectionClosed:
                log.info("pool worker %s: the front end at %s closed its pool link", self.worker_id, link.address)
                return "lost"
            if isinstance(msg, p.LoadModel):
                answer = self.holdings.ask(msg)
                if answer is not None:
                    link.send(answer)
            elif isinstance(msg, p.UnloadModel):
                self.holdings.unload((msg.model, msg.version))
            elif isinstance(msg, p.Drain):
                self.drain()

    async def _heartbeat(self, link: FrontLink, interval_s: float) -> str:
        """A Heartbeat and the PoolState (idle times, evictable as models age) every interval; "lost" once
        the link has been stuck too long (cut off), "left" once its front end is no longer named."""
        while True:
            await asyncio.sleep(interval_s)
            link.send(p.Heartbeat(1 if self.holdings.compute.locked() else 0, 0))
            link.send(self.holdings.state())
            if link.cut_off_if_stuck(self.holdings.residency.clock.now()):
                return "lost"
            left = self._left.get(link.index)
            if left is not None and left.is_set():
                return "left"

    def _tell(self, msg: p.Message) -> None:
        for link in self.links.values():
            link.send(msg)
