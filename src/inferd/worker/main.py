"""The worker process: owns one device, runs one model, one batch at a time.

    python -m inferd.worker.main --connect unix:/run/inferd.sock --model sim [--token T]
    python -m inferd.worker.main --connect a:9000,b:9000 ...   (one worker shared by two front ends)
    python -m inferd.worker.main --connect dns:fe:9000 ...     (every front end the name has, followed)

Per front end: join -> receive (batches, demand, sequences), with a heartbeat beside it. The device
(worker/device.py) runs one batch at a time for all of them: run -> deliver; a sync predict_batch runs in
a thread so heartbeats and the next (staged) batch keep flowing while the device is busy. The credit
ledger (worker/credits.py) keeps the worker at 1 running + 1 staged batch whichever front ends sent them.
The device never waits on one front end for the others, and one that stops reading is cut off
(worker/stuck.py). SIGTERM drains the worker (worker/signals.py, `Worker.drain`), as a front end's Drain does;
one saying its version is retired makes a worker of the default version join again, at the new one (`main`).
Which front ends it joins and leaves, and when: worker/joining.py (worker/discovery.py decides).
With `--pool NAME` the process is a pool worker instead (worker/pool.py): many models loaded on demand,
each served by a `Worker` of its own in the process (a model server).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec

from inferd.clock import MonotonicClock
from inferd.config import ConfigError
from inferd.kinds.llm.engine import LLMEngine
from inferd.kinds.worker_sides import WORKER_SIDES, WorkerSide
from inferd.observability.logging_setup import set_up_process
from inferd.observability.settings import from_environment
from inferd.wire import protocol as p
from inferd.worker.args import arguments
from inferd.worker.credits import CAP, CreditLedger, Seat
from inferd.worker.device import Device
from inferd.worker.discovery import FrontEnd
from inferd.worker.fronts import (
    FrontLink,
    SequenceOwners,
    give_up_when_silent,
    refused,
    take_batch,
    tell_credits,
    transport,
)
from inferd.worker.joining import JOIN_TIMEOUT_S, FrontEnds, keep_joined
from inferd.worker.pool import PoolWorker, settle_process
from inferd.worker.resolver import Resolver
from inferd.worker.signals import DRAIN_ANSWER_TIMEOUT_S, run_until_done
from inferd.worker.stuck import STUCK_AFTER_S

log = logging.getLogger("inferd.worker")


class Worker:
    def __init__(
        self, address: str, model: str, token: str, worker_id: str, reconnect: bool = False,
        model_repo: Path | None = None, model_version: int = 0, tls_context: ssl.SSLContext | None = None,
        stuck_after_s: float = STUCK_AFTER_S, zone: str | None = None, resolver: Resolver | None = None,
        device: Device | None = None, pool: str | None = None, seat: Seat | None = None,
        tell_credits: Callable[[], None] | None = None,
    ) -> None:
        self.connect = address
        """The front ends this worker serves (one, or several sharing it; dns: names followed)."""
        self.resolver = resolver or Resolver()
        self.zone = zone
        self.tls = tls_context
        """Verifies the front ends (TCP only); None: plain TCP, or Unix sockets."""
        self.model_name = model
        self.model_version = model_version
        """The version to serve; 0: the model's default version."""
        self.token = token
        self.worker_id = worker_id
        self.reconnect = reconnect
        self.stuck_after_s = stuck_after_s
        """A front end that reads nothing for this long while the worker has data for it is cut off."""
        self.device = device or Device(worker_id, model_repo)
        """Its own; or, a pool's model server, one handed the model loaded (worker/holdings.py)."""
        self.ledger: CreditLedger | Seat = seat or CreditLedger(MonotonicClock())
        """The batch slots (1 running + 1 staged) granted to the front ends: the cap holds across them (a
        pool's model server: its seat on the ledger its pool worker's models share, worker/holdings.py)."""
        self._tell_credits = tell_credits
        """A pool's model server: tells the front ends of every model of the pool worker (one ledger)."""
        self.links: dict[int, FrontLink] = {}
        """Front ends joined and ready, by the index of their link (in the order joined)."""
        self._left: dict[int, asyncio.Event] = {}
        """Each link's "leave" (set: its front end is no longer named, `leave`)."""
        self.owners = SequenceOwners(lambda: self.links)
        self._batches: asyncio.Queue[tuple[FrontLink, p.RunBatch] | None] = asyncio.Queue(maxsize=CAP + 1)
        self.side: WorkerSide | None = None
        """What it serves instead of a model, for every link (a kind's worker side: kinds/worker_sides.py)."""
        self._engine: LLMEngine | None = None
        """The continuous-batching engine, when the model is an LLM (instead of the batch loop)."""
        self.draining = False
        """Taking no new work (SIGTERM, or a front end's Drain): `drain`."""
        self.drain_asked = asyncio.Event()
        self._answered = asyncio.Event()
        """A front end answered Drain, or left (a draining worker waits for every one: `_drain`)."""
        self._stopped: bool | None = None  # `_stop_device` was called (True: finish); a later engine stops
        self._finished = asyncio.Event()
        """The device has stopped (drained): every link ends."""
        self.retired = False
        """It drains as a front end no longer serves its version (`Drain.retired`), not stopped by a signal."""
        self.pool = pool
        """The pool whose worker runs it: one model of a pool worker (worker/pool.py), said in its Hello."""

    async def run(self) -> int:
        """Serve the front ends. A local worker (a child of `inferd serve`) exits when its first front end
        (the one that runs it) goes and rejoins the others when they restart; a remote one (`inferd
        worker`) rejoins every front end that restarts, keeping its loaded model."""
        async with asyncio.TaskGroup() as tg:
            device = tg.create_task(self._run_device())
            draining = tg.create_task(self._drain())
            fronts = FrontEnds(self, self.connect, self.resolver, tg)
            outcome = await fronts.run()
            if self.draining and fronts.tasks:  # every front end's last results go out before it ends
                await asyncio.wait(fronts.tasks.values(), timeout=self.stuck_after_s)
            fronts.cancel()
            draining.cancel()
            self._stop_device(finish=outcome == "drained")
            if not self.device.loaded.is_set():
                device.cancel()
        return {"drained": 0, "lost": 0, "left": 0, "refused": 2, "load_failed": 3}[outcome]

    async def link(self, index: int, front: FrontEnd, reconnect: bool) -> str:
        """One front end: join it, serve it, and (with `reconnect`) join it again when it goes, until it
        is left ("left")."""
        left = self._left.setdefault(index, asyncio.Event())
        try:
            return await keep_joined(self, front, reconnect, left, lambda: self._session(index, front))
        finally:
            del self._left[index]

    def leave(self, index: int) -> None:
        """Its front end is no longer named (worker/discovery.py): drain from it alone. It sends no more
        work and answers Drain; the link ends ("left") once what it sent is back; the others go on."""
        if index in self._left:
            self._left[index].set()
        link = self.links.get(index)
        if link is not None and not link.leaving:
            log.info("worker %s leaving the front end at %s", self.worker_id, link.address)
            link.leaving = True
            if not link.answered_drain:
                link.send(p.Drain())

    def cut_unanswered(self, index: int) -> None:
        link = self.links.get(index)
        if link is not None and link.leaving and not link.answered_drain:
            link.cut_off(f"it was left and has not answered Drain within {DRAIN_ANSWER_TIMEOUT_S:g} s")

    async def _session(self, index: int, front: FrontEnd) -> str:
        """One connection: register, (re)load if needed, then receive until it ends; then close it."""
        link: FrontLink | None = None
        address = str(front)
        try:
            async with asyncio.timeout(JOIN_TIMEOUT_S):  # TimeoutError is an OSError: the attempt is "lost"
                reader, writer = await p.open_connection(front.address, self.tls, front.server_hostname)
                lifeline = index == 0 and not self.reconnect  # its going ends this (local) worker: never cut
                link = FrontLink.joined(index, address, writer, self.stuck_after_s, lifeline)
                host = socket.gethostname()
                link.send(p.Hello(self.worker_id, self.model_name, os.getpid(), host, self.token,
                                  version=self.model_version, credits=True, zone=self.zone, pool=self.pool))
                welcome = await p.read_message(reader)
            refusal = refused(self.ledger, welcome)
            if refusal:
                log.error("worker %s and the front end at %s: %s", self.worker_id, address, refusal)
                return "refused"
            assert isinstance(welcome, p.Welcome)
            give_up_when_silent(writer, welcome.silence_timeout_s)
            raw_config = msgspec.json.decode(welcome.model_config_json, type=dict)
            side = WORKER_SIDES.get(raw_config.get("kind", ""))  # e.g. a search shard replica, not a model
            if side is not None:
                self.side = self.side or side(self.worker_id)  # one for every front end
                return await self.side.serve(index, reader, writer, raw_config["version"], welcome.heartbeat_s)
            if self.draining:  # stopping: no model to load for it
                return "drained"
            if not await self.device.ensure_loaded(link, welcome):
                return "load_failed"
            self._start_engine()
            return await self._serve(link, reader, welcome)
        finally:
            if link is not None:
                link.close()

    async def _serve(self, link: FrontLink, reader: asyncio.StreamReader, welcome: p.Welcome) -> str:
        link.credits = welcome.credits
        self.ledger.join(link.index, legacy=not welcome.credits)
        self.links[link.index] = link
        link.leaving = link.index in self._left and self._left[link.index].is_set()
        if self.draining or link.leaving:  # it joined while the worker drains, or was left: no work
            link.send(p.Drain())
        self._grant()
        outcome = "lost"
        try:
            async with asyncio.TaskGroup() as tg:
                heartbeat = tg.create_task(self._heartbeat(link, welcome.heartbeat_s))
                receiving = tg.create_task(self._receive(link, reader))
                finished = tg.create_task(self._finished.wait())
                ends = {receiving, finished, heartbeat}  # the heartbeat returns when it cut the link off
                await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
                outcome = next((t.result() for t in (receiving, heartbeat) if t.done()), "drained")  # or "left"
                if outcome == "drained":  # deliver what the device holds first
                    await self._finished.wait()
                for task in (heartbeat, receiving, finished):
                    task.cancel()
        finally:
            self._detach(link)
        await link.finish(self.stuck_after_s)
        return outcome

    def _detach(self, link: FrontLink) -> None:
        """The link ended: its unused slots come back; batches it sent that have not started are dropped
        (nobody reads their results), its LLM sequences aborted."""
        self.links.pop(link.index, None)
        self.ledger.leave(link.index)
        link.closed = True
        if self._engine is not None:
            for abort in self.owners.release(link.index):
                self._engine.submit(abort)
        self._answered.set()
        self._grant()

    async def _receive(self, link: FrontLink, reader: asyncio.StreamReader) -> str:
        while True:
            try:
                msg = await p.read_message(reader)
            except p.ConnectionClosed:
                log.info("worker %s: the front end at %s closed the connection", self.worker_id, link.address)
                return "lost"
            if isinstance(msg, p.RunBatch):
                link.took()
                take_batch(self.ledger, link, len(msg.items))
                self._grant()
                await self._batches.put((link, msg))
            elif isinstance(msg, p.Demand):
                self.ledger.report(link.index, msg.queued, msg.oldest_age_s, msg.returned)
                self._grant()
            elif isinstance(msg, p.Drain):  # asked to, or the answer to ours: it sends no more work
                link.answered_drain = True
                self.retired = self.retired or (msg.retired and not link.leaving and not self.draining)
                self._answered.set()
                if not link.leaving:  # the worker drains (a left front end's answer ends its link only)
                    self.drain()
                if self._engine is None:  # reading on for an engine: aborts of the sequences it finishes
                    if not link.leaving:
                        return "drained"
                    await link.none_held()  # it sends no more: what it sent goes back first
                    return "left"
            elif isinstance(msg, (p.AddSequence, p.AbortSequence)) and self._engine is not None:
                self._engine.submit(self.owners.inbound(link, msg))

    def drain(self, signalled: bool = False) -> bool:
        """Take no new work, finish what the device holds, exit 0 (SIGTERM, or a front end's Drain):
        every front end is told (Drain) and answers Drain after the last work it sent; then the device
        stops. False: a kind's worker side (a search replica), which cannot drain on its own (stop it at
        once)."""
        self.retired = self.retired and not signalled  # SIGTERM: it exits, whatever a front end said
        if self.side is not None:
            return False
        if not self.draining:
            log.info("worker %s draining", self.worker_id)
        self.draining = True
        self.drain_asked.set()
        return True

    async def _drain(self) -> None:
        """Once asked: tell every front end, wait (bounded) until each has answered Drain or gone, then
        let the device finish what it holds (as a front end's Drain does for that one front end)."""
        await self.drain_asked.wait()
        for link in self.links.values():
            if not link.answered_drain:
                link.send(p.Drain())
        with contextlib.suppress(TimeoutError):  # a front end of an older inferd never answers
            async with asyncio.timeout(DRAIN_ANSWER_TIMEOUT_S):
                while not all(link.answered_drain for link in self.links.values()):
                    self._answered.clear()
                    await self._answered.wait()
        self._stop_device(finish=True)

    def _grant(self) -> None:
        """Hand out free batch slots, and tell front ends holding slots when the worker's state changed."""
        if self._engine is not None:  # an LLM engine batches continuously: no slots
            return
        if self._tell_credits is not None:  # a pool's model server: every model's front ends but the draining
            self._tell_credits()
        elif not self.draining:
            assert isinstance(self.ledger, CreditLedger)
            tell_credits(self.ledger, self.links)

    # ---- the device: one batch at a time, or the LLM engine ---------------------------------------------
    def _start_engine(self) -> None:
        if self._engine is None:
            self._engine = self.device.new_engine(self.owners)
            if self._engine is not None and self._stopped is not None:  # told to stop while it loaded
                self._engine.stop(finish_running=self._stopped)

    async def _run_device(self) -> None:
        await self.device.loaded.wait()
        self._start_engine()
        if self._engine is not None:
            await self._engine.run()
            await self.owners.flush()
        else:
            await self._run_batches()
        self._finished.set()

    async def _run_batches(self) -> None:
        while (entry := await self._batches.get()) is not None:
            link, batch = entry
            done = None if link.closed else await self.device.run_one(batch)
            with link.together():  # the result and the Credit freeing its slot: one write
                if done is not None:
                    link.send(done)  # not awaited: credits bound what waits for a front end (worker/stuck.py)
                self.ledger.finished()
                self._grant()
            link.answered()

    def _stop_device(self, finish: bool) -> None:
        """Drained: finish what the device holds. Lost: drop what has not started."""
        self._stopped = finish if self._stopped is None else self._stopped and finish
        if self._engine is not None:
            self._engine.stop(finish_running=finish)
            return
        if not finish:
            while not self._batches.empty():
                self._batches.get_nowait()
        with contextlib.suppress(asyncio.QueueFull):
            self._batches.put_nowait(None)

    async def _heartbeat(self, link: FrontLink, interval_s: float) -> str:
        """Heartbeats, without waiting for them to go out; "lost" once the link's write buffer has not
        moved for stuck_after_s (its front end stopped reading), having cut the link off."""
        while True:
            await asyncio.sleep(interval_s)
            self._grant()  # a slot held too long without use (credits.STALE_HOLD_S) frees the others
            device = self.device
            link.send(p.Heartbeat(device.running, device.completed, high_water=self.ledger.high_water))
            if link.cut_off_if_stuck(self.ledger.clock.now()):
                return "lost"
            if link.has_left(self.owners.holds(link.index)):
                return "left"  # an engine's last sequences there have finished; a batch device's last batches


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    observe = from_environment(
        os.environ, log_format=args.log_format, trace_endpoint=args.trace_endpoint, service_name=args.service_name
    )
    set_up_process(observe, args.log_level, "worker", [args.token])
    try:
        tls_context = transport(args.connect, args.ca_file, args.ca_pem, args.insecure)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    worker_id = args.worker_id or uuid.uuid4().hex[:8]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        if args.pool:  # many models on demand (worker/pool.py), each served by a Worker of its own
            pool = PoolWorker(
                args.connect, args.pool, args.token, worker_id, args.reconnect, args.model_repo, tls_context,
                args.stuck_after_s, args.zone, Resolver(args.hosts_file, args.resolve_every_s), model_server=Worker,
            )
            settle_process()
            return runner(run_until_done(pool.run(), lambda: pool.drain(signalled=True)))
        while True:  # once more each time its version is retired, serving the default version
            worker = Worker(
                args.connect, args.model, args.token, worker_id, args.reconnect, args.model_repo,
                args.model_version, tls_context, args.stuck_after_s, args.zone,
                Resolver(args.hosts_file, args.resolve_every_s),
            )
            code = runner(run_until_done(worker.run(), lambda w=worker: w.drain(signalled=True)))
            if code != 0 or not worker.retired or args.model_version or worker.side is not None:
                return code
            log.info("worker %s: its version is no longer served: joining again at the default version", worker_id)
    except KeyboardInterrupt:
        return 130
    except (ConnectionError, p.ConnectionClosed, BaseExceptionGroup) as exc:
        log.warning("worker %s lost its front end: %r", worker_id, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
