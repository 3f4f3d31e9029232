"""One canary decision for the whole server, whichever front end a request goes through.

Every front end runs the same traffic splits (gateway/traffic_control.py), but only the owner's decide:
it steps each canary on its clock and judges rollback on the outcomes of every front end. The others
(followers) neither step nor judge. Every SYNC_INTERVAL_S, each follower asks the owner over the
plan's owner channel (frontends/owner_channel.py) and sends the canary and baseline outcomes it saw since its last
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
import logging
from dataclasses import dataclass, field

import msgspec

from inferd.frontends.owner_channel import OwnerChannel, OwnerUnreachable
from inferd.frontends.plan import FrontendPlan
from inferd.gateway.traffic import SplitState
from inferd.gateway.traffic_control import Outcomes, Traffic

log = logging.getLogger("inferd.frontends")

SYNC_INTERVAL_S = 0.5
"""How often a follower exchanges with the owner, and how often the owner looks at its splits."""

EXCHANGE_TIMEOUT_S = 2.0
KIND = "traffic"


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
    def __init__(
        self,
        plan: FrontendPlan,
        traffic: Traffic,
        interval_s: float = SYNC_INTERVAL_S,
        channel: OwnerChannel | None = None,
    ) -> None:
        self.plan = plan
        self.traffic = traffic
        self.interval_s = interval_s
        self.channel = channel or OwnerChannel(plan)
        """The way to the owner (shared with the front end's other exchanges with it)."""
        self._failing = False
        if plan.is_owner:
            self.channel.handle(KIND, self._answer, EXCHANGE_TIMEOUT_S)

    async def open(self) -> None:
        """Before this front end listens: the owner opens its channel, a follower exchanges once."""
        if self.plan.is_owner:
            await self.channel.open()
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
            self.channel.close()

    # ---- follower -----------------------------------------------------------------------------------
    async def exchange(self) -> bool:
        """Send this front end's outcomes and states to the owner and apply its answer; False when the
        owner did not answer (its outcomes are dropped, its states stay)."""
        sent = encode(Exchange(self.traffic.shared(), self.traffic.take_outcomes()))
        try:
            answer = decode(await self.channel.ask(KIND, sent, EXCHANGE_TIMEOUT_S))
        except (OwnerUnreachable, msgspec.DecodeError) as exc:
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
    async def _answer(self, payload: bytes) -> bytes:
        message = decode(payload)
        self.traffic.absorb(message.outcomes)
        self.traffic.merge(message.states)
        return encode(Exchange(self.traffic.shared()))
