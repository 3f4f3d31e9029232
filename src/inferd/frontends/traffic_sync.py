"""One canary decision for the whole server, whichever front end a request goes through.

Every front end runs the same traffic splits (gateway/traffic_control.py), but only the owner's decide:
it steps each canary on its clock and judges rollback on the outcomes of every front end. The others
(followers) neither step nor judge. Every SYNC_INTERVAL_S, each follower connects to the owner's Unix
socket of the plan (`traffic_path`) and sends the canary and baseline outcomes it saw since its last
exchange, with its splits' states; the owner judges those outcomes with its own, moves its splits
forward to a follower's state when that one is further along (the owner restarted: the followers
remember), and answers with its states, which the follower applies. So within one interval of the
owner's decision (rollback, next step, promotion) every front end sends the same share to the canary.

A follower that starts (or restarts) exchanges once before it listens, so it starts with the server's
state, not with its config's first step. While the owner is away, the followers keep the state they
had and the outcomes they see in that time are not judged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import msgspec

from inferd.frontends.plan import FrontendPlan
from inferd.gateway.traffic import SplitState
from inferd.gateway.traffic_control import Outcomes, Traffic

log = logging.getLogger("inferd.frontends")

SYNC_INTERVAL_S = 0.5
"""How often a follower exchanges with the owner, and how often the owner looks at its splits."""

EXCHANGE_TIMEOUT_S = 2.0
MAX_MESSAGE_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class Exchange:
    """One message, either way: the sender's split states and (follower to owner) its outcomes."""

    states: dict[str, SplitState]
    outcomes: dict[str, Outcomes] = field(default_factory=dict)


def encode(message: Exchange) -> bytes:
    return msgspec.json.encode(message)


def decode(data: bytes) -> Exchange:
    return msgspec.json.decode(data, type=Exchange)


class TrafficSync:
    def __init__(self, plan: FrontendPlan, traffic: Traffic, interval_s: float = SYNC_INTERVAL_S) -> None:
        self.plan = plan
        self.traffic = traffic
        self.interval_s = interval_s
        self._server: asyncio.Server | None = None
        self._failing = False

    async def open(self) -> None:
        """Before this front end listens: the owner opens its socket, a follower exchanges once."""
        if self.plan.is_owner:
            self._server = await asyncio.start_unix_server(
                self._answer, path=self.plan.traffic_path(), limit=MAX_MESSAGE_BYTES
            )
        elif self.traffic.splits:
            await self.exchange()

    async def run(self) -> None:
        """Until cancelled: the owner looks at its splits, a follower exchanges, every interval."""
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                if self.plan.is_owner:
                    self.traffic.tick()
                elif self.traffic.splits:
                    await self.exchange()
        finally:
            if self._server is not None:
                self._server.close()

    # ---- follower -----------------------------------------------------------------------------------
    async def exchange(self) -> bool:
        """Send this front end's outcomes and states to the owner and apply its answer; False when the
        owner did not answer (its outcomes are dropped, its states stay)."""
        sent = encode(Exchange(self.traffic.shared(), self.traffic.take_outcomes()))
        try:
            async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(
                    self.plan.traffic_path(), limit=MAX_MESSAGE_BYTES
                )
                try:
                    writer.write(sent)
                    writer.write_eof()
                    answer = decode(await reader.read())
                finally:
                    writer.close()
        except (OSError, TimeoutError, msgspec.DecodeError) as exc:
            if not self._failing:
                log.warning("traffic: the owner front end did not answer (%s); splits stay as they are", exc)
            self._failing = True
            return False
        if self._failing:
            log.info("traffic: the owner front end answers again")
        self._failing = False
        self.traffic.merge(answer.states)
        return True

    # ---- owner --------------------------------------------------------------------------------------
    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
                message = decode(await reader.read())
                self.traffic.absorb(message.outcomes)
                self.traffic.merge(message.states)
                writer.write(encode(Exchange(self.traffic.shared())))
                await writer.drain()
        except (OSError, TimeoutError, msgspec.DecodeError) as exc:
            log.warning("traffic: a front end's exchange failed: %s", exc)
        finally:
            with contextlib.suppress(OSError):
                writer.close()
