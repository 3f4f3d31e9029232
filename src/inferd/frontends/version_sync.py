"""Every front end of `inferd serve --frontends N` serves the versions of a model the owner serves.

A rolling update (fleet/control.py) runs on the owner (front end 0), but its workers join every front end,
and a front end turns away for good a worker of a version it does not serve. So the followers follow the
owner: every SYNC_INTERVAL_S each one sends the owner what it serves (each model's versions, its default
version, and the versions that still hold work here) and gets the owner's versions and defaults; it then
serves the versions it lacks (loaded from the model repository as the owner loads them), takes the
owner's default, and stops serving the versions the owner dropped.

The owner waits on the followers twice during an update: before it starts the new version's workers,
until every follower that reported lately serves that version (else the update is refused and nothing
changes), and before it drains the last old worker, until those followers send new requests to the new
version and hold no work of the old one (at most FOLLOWERS_WAIT_S; then it goes on). A follower that
starts (or restarts) exchanges once before it takes workers or requests, so it serves what the owner
serves, and once more before it turns away a worker of a version it does not serve; while the owner is
away, a follower keeps what it serves.

Search indexes are not versions: kinds/search/shared_indexes.py follows them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any

import msgspec

from inferd.clock import Clock
from inferd.config import ConfigError
from inferd.errors import Conflict
from inferd.frontends import served_file
from inferd.frontends.followers import FollowerReports
from inferd.frontends.owner_channel import OwnerChannel, OwnerUnreachable
from inferd.frontends.plan import FrontendPlan

log = logging.getLogger("inferd.frontends")

KIND = "versions"
SYNC_INTERVAL_S = 0.25
EXCHANGE_TIMEOUT_S = 2.0
FOLLOWERS_WAIT_S = 10.0
RETRY_FAILED_S = 10.0
"""A version that failed to load here is tried again after this long (not on every exchange)."""


class Served(msgspec.Struct, frozen=True):
    """What one front end serves of one model."""

    versions: list[int]
    default: int
    busy: list[int] = []
    """(a follower's) The versions holding queued or running work there."""


class Report(msgspec.Struct, frozen=True):
    """A follower's: its place, and what it serves."""

    index: int
    models: dict[str, Served]


class Answer(msgspec.Struct, frozen=True):
    """The owner's: what it serves."""

    models: dict[str, Served]


class FollowerVersions(FollowerReports[dict[str, Served]]):
    """The owner's record of what each follower serves, and when it last said so."""

    def not_serving(self, model: str, version: int) -> list[int]:
        """The followers up that do not serve `version` of `model` yet."""
        return [i for i, models in self.live() if version not in _of(models, model).versions]

    def not_moved(self, model: str, old: int, new: int) -> list[int]:
        """The followers up whose default is not `new` yet, or that still hold work of `old`."""
        return [
            i
            for i, models in self.live()
            if _of(models, model).default != new or old in _of(models, model).busy
        ]


def _of(models: dict[str, Served], model: str) -> Served:
    return models.get(model, Served([], 0))


class VersionSync:
    def __init__(self, plan: FrontendPlan, channel: OwnerChannel, server: Any, clock: Clock) -> None:
        self.plan = plan
        self.channel = channel
        self.server = server
        """The composition root: its registry, add_version, remove_version, kinds, the fleet's
        version loader (the model repository) and (the owner's) launcher of local workers."""
        self.clock = clock
        self.followers = FollowerVersions(clock)
        self.wait_s = FOLLOWERS_WAIT_S
        self._failed: dict[tuple[str, int], float] = {}
        """(model, version) -> when it last failed to load here."""
        self._exchanging = asyncio.Lock()
        """A follower's exchanges, one at a time: an older answer is never applied after a newer one."""
        if plan.is_owner:
            channel.handle(KIND, self._answer, EXCHANGE_TIMEOUT_S)

    async def open(self) -> None:
        """A follower, before it takes workers or requests: serve what the owner serves (when it answers),
        and ask the owner again before its hub turns away a worker of a version not served here (the
        owner serves a version before it starts its workers: an owner that restarted, say)."""
        if not self.plan.is_owner:
            self.server.hub.before_refusal = self.exchange
            await self.exchange()

    async def run(self) -> None:
        """A follower: exchange with the owner every interval (the owner answers on its channel). The
        owner: keep what it serves in the parent's folder, for an owner started again (served_file.py)."""
        if self.plan.is_owner:
            await self._keep_saved()
            return
        while True:
            await asyncio.sleep(SYNC_INTERVAL_S)
            await self.exchange()

    async def _keep_saved(self) -> None:
        path, saved, failed = Path(self.plan.served_path()), None, ""
        while True:
            now = self._saved_view()
            if now != saved:
                try:
                    served_file.save(path, now)
                    saved, failed = now, ""
                except OSError as exc:  # said once; an owner started again then serves its config
                    if str(exc) != failed:
                        log.error("cannot save the versions served to %s: %s", path, exc)
                    failed = str(exc)
            await asyncio.sleep(SYNC_INTERVAL_S)

    def _saved_view(self) -> dict[str, served_file.SavedModel]:
        launcher, updates = self.server.supervisor, self.server.fleet.updates()
        return {
            name: served_file.SavedModel(
                s.versions,
                s.default,
                {v: [w.index for w in launcher.live_slots(name, v)] for v in s.versions},
                list(updates.get(name, ())),
            )
            for name, s in self._served().items()
        }

    # ---- owner, during a rolling update (fleet/control.py's Followers) -------------------------------
    async def until_serving(self, model: str, version: int) -> None:
        """Until the followers up serve `version`; Conflict when one does not within wait_s."""
        if not await self.followers.until(lambda: self.followers.not_serving(model, version), self.wait_s):
            raise Conflict(
                f"front end(s) {self.followers.not_serving(model, version)} do not serve version "
                f"{version} of {model!r} (see their logs: it must load from the model repository there "
                "too); nothing was changed"
            )

    async def until_moved(self, model: str, old: int, new: int) -> None:
        """Until the followers up send new requests to `new` and hold no work of `old` (at most wait_s)."""
        if not await self.followers.until(lambda: self.followers.not_moved(model, old, new), self.wait_s):
            log.warning(
                "model %s: front end(s) %s still use version %d; its last worker drains anyway",
                model,
                self.followers.not_moved(model, old, new),
                old,
            )

    # ---- follower -----------------------------------------------------------------------------------
    async def exchange(self) -> bool:
        """Report, and serve the versions the owner serves; False when the owner did not answer."""
        async with self._exchanging:
            report = Report(self.plan.index, self._served(with_busy=True))
            try:
                raw = await self.channel.ask(KIND, msgspec.msgpack.encode(report), EXCHANGE_TIMEOUT_S)
                answer = msgspec.msgpack.decode(raw, type=Answer)
            except (OwnerUnreachable, msgspec.DecodeError):
                return False  # the owner is away: what it serves cannot change meanwhile
            for model, served in sorted(answer.models.items()):
                if model in self.server.registry:
                    self._follow(model, served)
            return True

    def _follow(self, model: str, owner: Served) -> None:
        registry = self.server.registry
        for version in sorted(set(owner.versions) - set(registry.versions(model))):
            self._add(model, version)
        if not set(owner.versions) <= set(registry.versions(model)):
            return  # a version failed to load: keep serving the others, the owner's update waits
        for version in sorted(set(registry.versions(model)) - set(owner.versions)):
            self.server.remove_version(model, version)
            log.info(
                "model %s: version %d retired by the owner front end: no longer served here", model, version
            )
        if registry.default_version(model) != owner.default:
            registry.set_default(model, owner.default)
            log.info("model %s: default version %d, as on the owner front end", model, owner.default)

    def _add(self, model: str, version: int) -> None:
        load = self.server.fleet.load_version
        if load is None:
            log.error(
                "model %s: the owner serves version %d, but there is no model repository here", model, version
            )
            return
        if self.clock.now() < self._failed.get((model, version), -math.inf) + RETRY_FAILED_S:
            return  # it failed a moment ago: the owner's update has its 409; try again later, not every tick
        try:
            self.server.add_version(load(model, version))
        except (ConfigError, ValueError) as exc:
            self._failed[(model, version)] = self.clock.now()
            log.error("model %s: cannot serve version %d as the owner does: %s", model, version, exc)
            return
        except Exception:  # a model's own code (its load, its tokenizer): this front end serves on
            self._failed[(model, version)] = self.clock.now()
            log.exception("model %s: cannot serve version %d as the owner does", model, version)
            return
        log.info("model %s: version %d served by the owner front end: served here too", model, version)

    def _served(self, with_busy: bool = False) -> dict[str, Served]:
        registry = self.server.registry
        out = {}
        for name in registry.names():
            runtimes = [registry.get(name, v) for v in registry.versions(name)]
            if not all(self.server.kinds.get(rt.kind).rolls_versions for rt in runtimes):
                continue  # search indexes follow the owner otherwise; other kinds have no versions to roll
            several = with_busy and len(runtimes) > 1  # one version: nothing waits on its work
            busy = [rt.version for rt in runtimes if several and _holds_work(rt)]
            out[name] = Served(registry.versions(name), registry.default_version(name), busy)
        return out

    # ---- owner --------------------------------------------------------------------------------------
    async def _answer(self, payload: bytes) -> bytes:
        report = msgspec.msgpack.decode(payload, type=Report)
        self.followers.report(report.index, report.models)
        return msgspec.msgpack.encode(Answer(self._served()))


def _holds_work(rt: Any) -> bool:
    stats = rt.statistics()
    return stats.queued > 0 or stats.in_flight > 0
