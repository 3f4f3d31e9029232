"""`POST /admin/reload` reaches every front end of `inferd serve --frontends N` before it is answered.

The owner serves the admin API. It re-reads the config file (a file that does not validate is refused
whole, as with one front end), names what it now runs a new generation, and answers once every follower
up has re-read the file for that generation: at most FOLLOWERS_WAIT_S, and the answer says which front
ends reloaded, which refused the file (and why) and which did not answer in time. So a client that adds
an API key and reloads can use the key at once, whichever front end its next connection reaches.

Each follower asks the owner its generation every SYNC_INTERVAL_S (saying which one it has taken) and
re-reads the file when the owner's differs. A generation names the owner process too: after the owner
restarts (it read the file as it started) the followers read it once more. `kill -HUP` of the parent still
reaches every front end, each re-reading the file, answered by nobody.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from inferd.clock import Clock
from inferd.config import ConfigError
from inferd.frontends.followers import FollowerReports
from inferd.frontends.owner_channel import OwnerChannel, OwnerUnreachable
from inferd.frontends.plan import FrontendPlan

log = logging.getLogger("inferd.frontends")

KIND = "config"
SYNC_INTERVAL_S = 0.25
EXCHANGE_TIMEOUT_S = 2.0
FOLLOWERS_WAIT_S = 10.0


class Generation(msgspec.Struct, frozen=True):
    """What the owner runs: its process (a random name) and how many reloads it has made."""

    owner: str
    reloads: int

    def covers(self, other: Generation) -> bool:
        """Read at or after `other` (by the same owner process)."""
        return self.owner == other.owner and self.reloads >= other.reloads


NONE = Generation("", -1)


def one_frontend() -> dict[str, Any]:
    """The answer's `frontends` when there is one."""
    return {"count": 1, "reloaded": [0], "refused": {}, "not_answered": [], "complete": True}


class Taken(msgspec.Struct, frozen=True):
    """A follower's: the owner generation it has read the file for, and, if the file was refused
    then, why."""

    index: int
    generation: Generation
    error: str = ""


class FollowerConfigs(FollowerReports[Taken]):
    """The owner's record of what each follower has taken, and when it last asked."""

    def behind(self, generation: Generation) -> list[int]:
        """The followers up that have not taken `generation` (or a later one) yet."""
        return [i for i, t in self.live() if not t.generation.covers(generation)]

    def outcome(self, generation: Generation, count: int) -> dict[str, Any]:
        """Every front end's part in the reload to `generation` (0, the owner, reloaded already)."""
        taken = {i: t for i, t in self.live() if t.generation.covers(generation)}
        refused = {str(i): t.error for i, t in sorted(taken.items()) if t.error}
        not_answered = sorted(set(range(1, count)) - set(taken))
        return {
            "count": count,
            "reloaded": [0, *sorted(i for i, t in taken.items() if not t.error)],
            "refused": refused,
            "not_answered": not_answered,
            "complete": not refused and not not_answered,
        }


class ConfigSync:
    def __init__(
        self,
        plan: FrontendPlan,
        channel: OwnerChannel,
        reload: Callable[[], Mapping[str, Any]] | None,
        clock: Clock,
    ) -> None:
        self.plan = plan
        self.channel = channel
        self.reload_here = reload
        """Re-read the config file in this front end (ConfigError: refused whole, the running one stays);
        None: the server has no config file (a follower then takes every generation as it is)."""
        self.clock = clock
        self.followers = FollowerConfigs(clock)
        self.wait_s = FOLLOWERS_WAIT_S
        self.generation = Generation(secrets.token_hex(4), 0)
        """(owner) What it runs."""
        self.taken = Taken(plan.index, NONE)
        """(follower) The owner generation it has read the file for."""
        if plan.is_owner:
            channel.handle(KIND, self._answer, EXCHANGE_TIMEOUT_S)

    # ---- owner ---------------------------------------------------------------------------------------
    async def reload(self) -> dict[str, Any]:
        """POST /admin/reload: here (ConfigError: refused, nothing changes anywhere), then on every
        follower up (the answer's `frontends`)."""
        if self.reload_here is None:
            raise ConfigError("the server was started without --config: there is no file to reload")
        summary = dict(self.reload_here())
        generation = self.generation = Generation(self.generation.owner, self.generation.reloads + 1)
        await self.followers.until(lambda: self.followers.behind(generation), self.wait_s)
        outcome = self.followers.outcome(generation, self.plan.count)
        if outcome["refused"] or outcome["not_answered"]:
            log.warning("reload: front ends %s refused the file or did not answer in time", outcome)
        return {**summary, "frontends": outcome}

    async def _answer(self, payload: bytes) -> bytes:
        taken = msgspec.json.decode(payload, type=Taken)
        self.followers.report(taken.index, taken)
        return msgspec.json.encode(self.generation)

    # ---- follower ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """A follower: ask the owner every interval, re-read the file when its generation moved."""
        while not self.plan.is_owner:
            await asyncio.sleep(SYNC_INTERVAL_S)
            await self.exchange()

    async def exchange(self) -> None:
        try:
            raw = await self.channel.ask(KIND, msgspec.json.encode(self.taken), EXCHANGE_TIMEOUT_S)
            generation = msgspec.json.decode(raw, type=Generation)
        except (OwnerUnreachable, msgspec.DecodeError):
            return  # the owner is away (restarting, or died answering): this front end keeps what it runs
        if generation == self.taken.generation:
            return
        error = ""
        try:
            if self.reload_here is not None:
                self.reload_here()
        except ConfigError as exc:
            error = str(exc)
            log.error("reload: config not reloaded, the running tenants, keys and models stay: %s", exc)
        except Exception as exc:  # a bug in applying it: said to the owner, and the sync goes on
            error = f"{type(exc).__name__}: {exc}"
            log.exception("reload: applying the config failed; the running tenants, keys and models stay")
        self.taken = Taken(self.plan.index, generation, error)
        await self.exchange()  # tell the owner now, not an interval later
