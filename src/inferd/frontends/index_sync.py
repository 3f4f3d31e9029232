"""Every front end of `inferd serve --frontends N` serves the same search indexes.

An index created or deleted through the API is created or deleted by the owner (front end 0; a
follower forwards the PUT or DELETE, frontends/search_writes.py). The followers learn of it over the owner
channel: every SYNC_INTERVAL_S each one sends the owner the indexes it serves and gets the owner's
(with their settings), then serves the ones it lacks, stops serving the ones the owner dropped, and
serves again (anew) one whose settings differ from the owner's. The owner starts a new index's replica
workers only once every follower that reported lately serves the index too (at most FOLLOWERS_WAIT_S),
because a worker joins every front end and a front end that does not know its index would turn it away
for good; and a delete answers once those followers no longer serve the index (as long at most), so
that an index created again under its name is never taken for the old one (its replicas, seqs and
cached results). A follower that is down meanwhile serves data_dir's indexes when it starts again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.frontends.followers import FollowerReports
from inferd.frontends.owner_channel import OwnerChannel, OwnerUnreachable
from inferd.frontends.plan import FrontendPlan
from inferd.kinds.search.config import index_config, params_of, parse_params
from inferd.kinds.search.kind import API

log = logging.getLogger("inferd.search")

KIND = "search-indexes"
SYNC_INTERVAL_S = 0.25
EXCHANGE_TIMEOUT_S = 2.0
FOLLOWERS_WAIT_S = 5.0


class Report(msgspec.Struct, frozen=True):
    """A follower's: its place, and the indexes it serves."""

    index: int
    serving: list[str]


class Indexes(msgspec.Struct, frozen=True):
    """The owner's: the indexes it serves and their settings."""

    settings: dict[str, dict[str, Any]]


class FollowerIndexes(FollowerReports[frozenset[str]]):
    """The owner's record of the indexes each follower serves, and when it last said so."""

    def missing(self, name: str) -> list[int]:
        """The followers up (reported lately) that do not serve `name` yet."""
        return [i for i, serving in self.live() if name not in serving]

    def still_serving(self, name: str) -> list[int]:
        """The followers up that serve `name` still (a deleted index)."""
        return [i for i, serving in self.live() if name in serving]


class IndexSync:
    def __init__(
        self,
        plan: FrontendPlan,
        channel: OwnerChannel,
        server: Any,
        clock: Clock,
    ) -> None:
        self.plan = plan
        self.channel = channel
        self.server = server
        """The composition root: its registry, add_version and remove_version."""
        self.reports = FollowerIndexes(clock)
        self._exchanging = asyncio.Lock()
        """A follower's exchanges, one at a time: an older answer is never applied after a newer one."""
        if plan.is_owner:
            channel.handle(KIND, self._answer, EXCHANGE_TIMEOUT_S)

    async def run(self) -> None:
        """A follower: exchange with the owner every interval (the owner answers on its channel)."""
        while not self.plan.is_owner:
            await self.exchange()
            await asyncio.sleep(SYNC_INTERVAL_S)

    async def until_followers_serve(self, name: str) -> None:
        """The owner, before it starts a new index's workers: until the followers up serve it."""
        await self._until(self.reports.missing, name, "do not serve it yet")

    async def until_followers_drop(self, name: str) -> None:
        """The owner, once it deleted an index: until the followers up no longer serve it."""
        await self._until(self.reports.still_serving, name, "serve it still")

    async def _until(self, waiting: Callable[[str], list[int]], name: str, what: str) -> None:
        if not await self.reports.until(lambda: waiting(name), FOLLOWERS_WAIT_S):
            log.warning("index %s: front ends %s %s", name, waiting(name), what)

    # ---- follower -----------------------------------------------------------------------------------
    async def exchange(self) -> bool:
        """Report, and serve what the owner serves; False when the owner did not answer."""
        async with self._exchanging:
            report = Report(self.plan.index, self._serving())
            try:
                raw = await self.channel.ask(KIND, msgspec.msgpack.encode(report), EXCHANGE_TIMEOUT_S)
                answer = msgspec.msgpack.decode(raw, type=Indexes)
            except (OwnerUnreachable, msgspec.DecodeError):
                return False  # the owner is away: its indexes cannot change meanwhile
            for name in sorted(set(self._serving()) - set(answer.settings)):
                self._drop(name)
            for name in sorted(set(self._serving()) & set(answer.settings)):
                if self._other_settings(name, answer.settings[name]):  # deleted and created again
                    self._drop(name)
            for name in sorted(set(answer.settings) - set(self._serving())):
                self._add(name, answer.settings[name])
            return True

    def _serving(self) -> list[str]:
        """The served models of the kinds that come in on the search routes (`Kind.api`)."""
        return self.server.registry.names(self.server.kinds.serving(API))

    def _other_settings(self, name: str, settings: dict[str, Any]) -> bool:
        mine = params_of(self.server.registry.get(name).config)
        return mine != parse_params(settings, f"settings of index {name!r}")

    def _add(self, name: str, settings: dict[str, Any]) -> None:
        if name in self.server.registry:  # a declared model of that name wins
            return
        config: ModelConfig = index_config(name, parse_params(settings, f"settings of index {name!r}"))
        self.server.add_version(config)
        log.info("index %s created by the owner front end: served here too", name)

    def _drop(self, name: str) -> None:
        rt = self.server.registry.get(name)
        self.server.remove_version(name, rt.version)
        log.info("index %s deleted by the owner front end: no longer served here", name)

    # ---- owner --------------------------------------------------------------------------------------
    async def _answer(self, payload: bytes) -> bytes:
        report = msgspec.msgpack.decode(payload, type=Report)
        self.reports.report(report.index, frozenset(report.serving))
        return msgspec.msgpack.encode(Indexes(self._settings()))

    def _settings(self) -> dict[str, dict[str, Any]]:
        registry = self.server.registry
        return {name: registry.get(name).config.params for name in self._serving()}
