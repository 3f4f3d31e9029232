"""The worker's links to its front ends, as worker/discovery.py decides them: one task per front end
joined (`Joiner.link`: join it, serve it, rejoin it when it goes), started when an address appears,
asked to leave when it is gone, and the names looked up again on time.

The loop reads: join the fixed addresses -> wait (a link ends, a name is due, or the worker drains) ->
look up the names due -> join / leave what their answers say -> again, until the links the worker waits
for have all ended (or it drains with none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from inferd.clock import MonotonicClock
from inferd.wire import protocol as p
from inferd.worker.discovery import Change, Discovery, FrontEnd, Name, parse_connect
from inferd.worker.fronts import untrusted
from inferd.worker.orphans import orphaned
from inferd.worker.resolver import Resolver
from inferd.worker.signals import DRAIN_ANSWER_TIMEOUT_S

log = logging.getLogger("inferd.worker")

JOIN_TIMEOUT_S = 5.0
"""Most time one attempt to join (connect, TLS handshake, Hello -> Welcome) may take; an attempt caught in
a partition is abandoned and retried, so a worker rejoins within seconds of the network healing."""


class Joiner(Protocol):
    """What the links run on: the worker (worker/main.py `Worker`)."""

    worker_id: str
    reconnect: bool

    def link(self, index: int, front: FrontEnd, reconnect: bool) -> Coroutine[Any, Any, str]:
        """Join `front`, serve it and (with `reconnect`) rejoin it when it goes; the outcome."""
        ...

    def leave(self, index: int) -> None:
        """Leave that front end: drain from it alone (what it sent finishes first)."""
        ...

    def cut_unanswered(self, index: int) -> None:
        """Cut off that front end if it is joined and has not answered the Drain of `leave`."""
        ...

    draining: bool
    drain_asked: asyncio.Event
    """Set once the worker drains."""


class FrontEnds:
    """The link tasks of one worker, in its task group."""

    def __init__(self, joiner: Joiner, connect: str, resolver: Resolver, tg: asyncio.TaskGroup) -> None:
        self.joiner = joiner
        self.resolver = resolver
        self.tg = tg
        fixed, names = parse_connect(connect)
        self.discovery = Discovery(fixed, names, MonotonicClock(), resolver.every_s)
        self._next_index = 0
        self._index: dict[str, int] = {}
        """The link serving each front end joined, by address."""
        self.tasks: dict[int, asyncio.Task[str]] = {}
        """Every link task, those leaving included."""
        self._left: set[int] = set()

    async def run(self) -> str:
        """Run until the links waited for have ended: every one of a remote worker's (`reconnect`; they
        end when refused, drained or orphaned), a local worker's first (its server); or the worker
        drains with none joined. Returns the first one's outcome ("drained" when draining)."""
        self._apply(self.discovery.start())
        drained = self.tg.create_task(self.joiner.drain_asked.wait())
        try:
            while not self._ended():
                await self._wait(drained)
                for name in self.discovery.due():
                    self._apply(await self._look_up(name))
        finally:
            drained.cancel()
        if self.joiner.draining:
            return "drained"
        return next(t.result() for t in self._watched())

    def _watched(self) -> list[asyncio.Task[str]]:
        links = [t for i, t in self.tasks.items() if i not in self._left]
        return links if self.joiner.reconnect else links[:1]

    def _ended(self) -> bool:
        watched = self._watched()
        if watched:
            return all(t.done() for t in watched)
        return self.joiner.draining

    async def _wait(self, drained: asyncio.Task[bool]) -> None:
        next_at = self.discovery.next_at()
        timeout = None if next_at is None else max(0.0, next_at - self.discovery.clock.now())
        waits = {t for t in self._watched() if not t.done()}
        if not self.joiner.draining:
            waits.add(drained)
        if waits:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        elif timeout is not None:
            await asyncio.sleep(timeout)

    async def _look_up(self, name: Name) -> Change:
        try:
            ips = await self.resolver.addresses(name)
        except (OSError, UnicodeError) as exc:  # gaierror, TimeoutError, a name IDNA refuses: all stay
            return self.discovery.observe(name, (), f"{type(exc).__name__}: {exc}")
        return self.discovery.observe(name, ips, "" if ips else "no address")

    def _apply(self, change: Change) -> None:
        for note in change.notes:
            log.info("worker %s: %s", self.joiner.worker_id, note)
        for front in change.leave:
            index = self._index.pop(front.address, None)
            if index is None:  # never joined (it came while the worker drained)
                continue
            self._left.add(index)
            self.joiner.leave(index)
            self.tg.create_task(self._see_off(index, self.tasks[index]))
        for front in change.join:
            if self.joiner.draining:  # no new front end for a worker on its way out
                continue
            index = self._next_index
            self._next_index += 1
            self._index[front.address] = index
            reconnect = self.joiner.reconnect or index > 0
            self.tasks[index] = self.tg.create_task(self.joiner.link(index, front, reconnect))

    async def _see_off(self, index: int, task: asyncio.Task[str]) -> None:
        """A front end left: one that has not answered its Drain within DRAIN_ANSWER_TIMEOUT_S (gone, or
        an older inferd) is cut off; what it held it then fails over or retries, as for any lost worker."""
        while not task.done():
            await asyncio.wait({task}, timeout=DRAIN_ANSWER_TIMEOUT_S)
            if not task.done():
                self.joiner.cut_unanswered(index)
        del self.tasks[index]  # gone for good: a worker behind a name whose front ends churn keeps none
        self._left.discard(index)

    def cancel(self) -> None:
        for task in self.tasks.values():
            task.cancel()


async def keep_joined(
    joiner: Joiner, front: FrontEnd, reconnect: bool, left: asyncio.Event, session: Callable[[], Awaitable[str]]
) -> str:
    """One front end's link task: run `session` (join it, serve it: its outcome), and (with `reconnect`) run
    it again when the front end goes, backing off, until it ends for good ("drained", "refused",
    "load_failed"), the worker drains, or the front end is left (`left` set: "left")."""
    delay_s = 0.2
    while True:
        try:
            outcome = await session()
        except ssl.SSLCertVerificationError as exc:  # retrying cannot fix it: the operator must
            log.error("worker %s: %s", joiner.worker_id, untrusted(front, exc))
            outcome = "refused"
        except (OSError, p.ConnectionClosed) as exc:
            outcome = "lost"
            log.warning("worker %s: cannot reach the front end at %s: %s", joiner.worker_id, front, exc)
        if outcome in ("drained", "refused", "load_failed") or not reconnect or joiner.draining:
            return outcome
        if left.is_set() or orphaned(joiner.worker_id):  # no front end comes back: let go of the device
            return "left" if left.is_set() else outcome
        delay_s = 0.2 if outcome == "served" else delay_s
        with contextlib.suppress(TimeoutError):  # the next try, unless it is left meanwhile
            async with asyncio.timeout(delay_s):
                await left.wait()
        delay_s = min(2.0, delay_s * 2)
        if joiner.draining or left.is_set():
            return "left" if left.is_set() else outcome
