"""Which versions are served where: the one module that owns it, over the `served` document.

The document (`ServedState`, schema SCHEMA, its revision the store's) holds, per model of a kind that
rolls versions, its served versions, its default version and the rolling update in progress ([old, new,
workers] or []), the models not served (model control, followed as fleet/control_share.py says), and the
config generation (cluster/reload.py). Only the holder of the lease writes the models (fenced by its
grant: cluster/lease.py); a reload moves the generation by compare-and-set.

- **Every front end follows it** (cluster/follower.py's loop calls `apply`): it serves the versions it
  lacks (loaded from the model repository, as the holder loaded them), takes the default, and stops
  serving the versions dropped. A version that fails to load is tried again after RETRY_FAILED_S, and
  meanwhile the front end serves the others (and takes no default nor retires anything of that model:
  the holder's update waits on it, and is refused). A hub about to turn away a worker of a version not
  served reads the document once more first (the holder serves a version before it starts its workers).
- **Every front end reports** what it serves in its `serving/<frontend>` document (ttl REPORT_TTL_S,
  written after each apply and every REPORT_EVERY_S): each model's versions, default, and the versions
  holding work here; and the config generation it has read the file for, with a refusal's reason.
- **The holder writes** what it serves (`publish`, every REPORT_EVERY_S and before each wait), and a
  rolling update (fleet/control.py, through the `Followers` protocol) waits on the reports: before it
  starts the new version's workers, until every live front end serves the new version (else the update
  is refused: 409), and before it drains the last old worker, until they all send new requests to the
  new version and hold no work of the old (at most FOLLOWERS_WAIT_S; then it goes on). A front end that
  died stops counting once its report expires.
- **A new holder** (the owner of `--frontends N` started again, another front end once the holder's
  lease lapsed) settles an update the previous holder left running where its default was (as
  cluster/saved.py's `SavedModel.settled`) before it writes.

When the store fails, every front end keeps serving what it serves; changes (an update, a scale) are
refused with 503 naming the store (`changes`), and the holder stops acting once its lease lapses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Collection, Iterator
from typing import Any, Protocol

import msgspec

from inferd.clock import Clock
from inferd.cluster.follower import Document
from inferd.cluster.lease import LeaseKeeper
from inferd.cluster.reports import Reports
from inferd.cluster.store import Fenced, Store, StoreError, Versioned
from inferd.config import ConfigError
from inferd.errors import ClusterUnavailable, Conflict

log = logging.getLogger("inferd.cluster")

SCHEMA = 1
SERVING = "serving/"
REPORT_EVERY_S = 0.5
REPORT_TTL_S = 2.0
"""A front end whose report is older than this (dead, hung, cut from the store) is not waited for."""
FOLLOWERS_WAIT_S = 10.0
RETRY_FAILED_S = 10.0
"""A version that failed to load here is tried again after this long (not on every read)."""


class ModelServed(msgspec.Struct, frozen=True):
    versions: list[int] = []
    default: int = 0
    updating: list[int] = []
    """[old version, new version, workers] while a rolling update runs (FleetControl.updates); [] else."""


class ServedState(msgspec.Struct, frozen=True):
    """The `served` document."""

    schema: int = SCHEMA
    models: dict[str, ModelServed] = {}
    generation: int = 0
    """The config generation: moved by every `POST /admin/reload` (cluster/reload.py)."""
    unloaded: dict[str, str] = {}
    """Model control's (fleet/control_share.py): the models not served, and why; `loading`: those loading."""
    loading: list[str] = []


SERVED = Document("served", ServedState, ServedState)


class Served(msgspec.Struct, frozen=True):
    """What one front end serves of one model."""

    versions: list[int]
    default: int
    busy: list[int] = []
    """The versions holding queued or running work there (when it serves several)."""


class Serving(msgspec.Struct, frozen=True):
    """A front end's report, `serving/<frontend>`."""

    frontend: str
    index: int = -1
    """Its place among the `--frontends N` of one host (-1: none)."""
    models: dict[str, Served] = {}
    generation: int = -1
    """The config generation it has read the file for (-1: none yet)."""
    refused: str = ""
    """Why it refused the file of that generation ("" when it took it)."""
    unloaded: dict[str, bool] = {}  # the models it refuses (model control), each: whether it holds work there

    @property
    def name(self) -> int | str:
        """How answers name it: its index on one host, else its id."""
        return self.index if self.index >= 0 else self.frontend

    def of(self, model: str) -> Served:
        return self.models.get(model, Served([], 0))


def serving_reports(store: Store, me: str) -> Reports[Serving]:
    """The front ends' `serving/<frontend>` reports (cluster/reports.py), as `me` writes and reads them."""
    return Reports(store, SERVING, Serving, me, REPORT_TTL_S)


def names(reports: dict[str, Serving]) -> list[Any]:
    """How answers name these front ends (by their index on one host, else their id), in order."""
    return sorted((r.name for r in reports.values()), key=str)


@contextlib.contextmanager
def changes() -> Iterator[None]:
    """The one place a failed change of the served state becomes a 503 naming the store."""
    try:
        yield
    except Fenced as exc:
        raise ClusterUnavailable(f"this front end no longer decides for the server ({exc}); try again") from None
    except StoreError as exc:
        raise ClusterUnavailable(
            f"the cluster store does not answer ({exc}): changes are refused until it does; serving goes on"
        ) from None


class GenerationFollower(Protocol):
    """What follows the config generation here (cluster/reload.py's ConfigReload)."""

    taken: int | None
    refused: str

    async def apply(self, generation: int) -> None: ...


class ControlShare(Protocol):
    """Model control here (fleet/control_share.py's ControlFollower)."""

    def written(self) -> tuple[dict[str, str], list[str]]: ...

    def wanted(self, model: str) -> bool: ...

    def started_with(self, model: str, version: int | None) -> Any: ...

    def follow(self, unloaded: dict[str, str], loading: list[str], served: Collection[str]) -> None: ...

    def refused(self) -> dict[str, bool]: ...


class ServedVersions:
    def __init__(
        self, store: Store, me: str, server: Any, clock: Clock, keeper: LeaseKeeper | None = None, index: int = -1
    ) -> None:
        self.store = store
        self.me = me
        self.index = index
        self.reports = serving_reports(store, me)
        self.server = server
        """The composition root: its registry, add_version, remove_version, kinds and fleet (its version
        loader, the model repository, and its rolling updates)."""
        self.clock = clock
        self.keeper = keeper
        """The lease, where this front end contends for it (None: it never decides)."""
        self.config: GenerationFollower | None = None
        self.control: ControlShare | None = None  # model control, shared with the others (None: alone)
        self.store_up: Callable[[], bool] = _always
        """Whether the store answered this front end's last read (cluster/follower.py's `up`)."""
        self.wait_s = FOLLOWERS_WAIT_S
        self.state = ServedState()
        self._failed: dict[tuple[str, int], float] = {}
        """(model, version) -> when it last failed to load here."""
        self._epoch: int | None = None
        """The epoch this front end last wrote under (a new one: it settles what a previous holder left)."""
        self._failing = False
        self.refresh_members: Callable[[], Awaitable[object]] | None = None
        """Read the front ends' records again (cluster/members.py) once they all serve an update's new
        version, before its workers start: they join every front end live then."""

    def holds(self) -> bool:
        return self.keeper is not None and self.keeper.grant() is not None

    def check_holder(self) -> None:
        """Before a change (an update, a scale): ClusterUnavailable unless this front end decides now."""
        if self.keeper is None:
            raise ClusterUnavailable("this front end does not decide for the server: ask the one that does")
        if not self.store_up():
            raise ClusterUnavailable(
                "the cluster store did not answer this front end's last read: changes are refused until it "
                "does (a change made now could not be shared); serving goes on"
            )
        if self.keeper.grant() is None:
            raise ClusterUnavailable(
                "this front end does not hold the lease of the server's decisions now (the cluster store "
                "does not answer, or another front end holds it): changes are refused; serving goes on"
            )

    # ---- every front end ------------------------------------------------------------------------------
    async def apply(self, found: Versioned | None) -> None:
        """The follower's applier of `served`: serve what it says, then report."""
        _, self.state = SERVED.decode(found)
        updating = self.server.fleet.updates()
        if not self.holds():  # the holder's own registry is what it writes
            for model, ms in sorted(self.state.models.items()):
                wanted = self.control is not None and self.control.wanted(model)  # loaded by the server
                if (model in self.server.registry or wanted) and model not in updating:
                    self._follow(model, ms)
            if self.control is not None:
                self.control.follow(self.state.unloaded, self.state.loading, self.state.models.keys())
        if self.config is not None:
            await self.config.apply(self.state.generation)
        with contextlib.suppress(StoreError):
            await self.report()

    def _follow(self, model: str, ms: ModelServed) -> None:
        registry = self.server.registry
        for version in sorted(set(ms.versions) - set(registry.versions(model))):
            self._add(model, version)
        if not set(ms.versions) <= set(registry.versions(model)):
            return  # a version failed to load: keep serving the others, the holder's update waits
        for version in sorted(set(registry.versions(model)) - set(ms.versions)):
            self.server.fleet.move_slots(model, version, ms.default)  # its local workers follow the default
            self.server.remove_version(model, version)
            log.info("model %s: version %d retired by the server: no longer served here", model, version)
        if registry.default_version(model) != ms.default:
            registry.set_default(model, ms.default)
            log.info("model %s: default version %d, as the server serves", model, ms.default)

    def _add(self, model: str, version: int) -> None:
        load = self.server.fleet.load_version or (None if self.control is None else self.control.started_with)
        if load is None:
            log.error("model %s: the server serves version %d, but there is no model repository here", model, version)
            return
        if self.clock.now() < self._failed.get((model, version), -math.inf) + RETRY_FAILED_S:
            return  # it failed a moment ago: the holder's update has its 409; try again later, not every read
        try:
            self.server.add_version(load(model, version))
        except (ConfigError, ValueError) as exc:
            self._failed[(model, version)] = self.clock.now()
            log.error("model %s: cannot serve version %d as the server does: %s", model, version, exc)
            return
        except Exception:  # a model's own code (its load, its tokenizer): this front end serves on
            self._failed[(model, version)] = self.clock.now()
            log.exception("model %s: cannot serve version %d as the server does", model, version)
            return
        log.info("model %s: version %d served by the server: served here too", model, version)

    def served(self, with_busy: bool = False) -> dict[str, Served]:
        """What this front end serves, of the kinds that roll versions."""
        registry = self.server.registry
        out = {}
        for name in registry.names():
            runtimes = [registry.get(name, v) for v in registry.versions(name)]
            if not all(self.server.kinds.get(rt.kind).rolls_versions for rt in runtimes):
                continue  # search indexes are followed otherwise; other kinds have no versions to roll
            several = with_busy and len(runtimes) > 1  # one version: nothing waits on its work
            busy = [rt.version for rt in runtimes if several and _holds_work(rt)]
            out[name] = Served(registry.versions(name), registry.default_version(name), busy)
        return out

    async def report(self) -> None:
        generation, refused = (-1, "") if self.config is None else (self.config.taken, self.config.refused)
        unloaded, served = {} if self.control is None else self.control.refused(), self.served(with_busy=True)
        report = Serving(self.me, self.index, served, -1 if generation is None else generation, refused, unloaded)
        await self.reports.publish(report)

    async def run(self) -> None:
        """Until cancelled: the holder writes what it serves, every front end reports, every interval."""
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            try:
                if self.holds():
                    await self.publish()
                await self.report()
            except StoreError as exc:
                if not self._failing:
                    log.warning("the served state: the cluster store does not take this front end's writes (%s)", exc)
                self._failing = True
            else:
                self._failing = False

    # ---- the holder -----------------------------------------------------------------------------------
    def view(self) -> dict[str, ModelServed]:
        updates = self.server.fleet.updates()
        return {
            name: ModelServed(s.versions, s.default, list(updates.get(name, ())))
            for name, s in self.served().items()
        }

    async def publish(self) -> None:
        """The holder: write what it serves (fenced by its grant). Fenced, StoreError; nothing without
        the lease."""
        grant = self.keeper.grant() if self.keeper is not None else None
        if grant is None:
            return
        if self._epoch != grant.epoch:  # a new holder: the server's state first, as the last one left it
            _, self.state = await SERVED.read(self.store)
            self._adopt()
            self._settle()
            self._epoch = grant.epoch
        view = self.view()
        unloaded, loading = ({}, []) if self.control is None else self.control.written()

        def change(state: ServedState) -> ServedState | None:
            if (state.models, state.unloaded, state.loading) == (view, unloaded, loading):
                return None
            return msgspec.structs.replace(state, models=view, unloaded=unloaded, loading=loading)

        _, self.state = await SERVED.update(self.store, change, fence=grant)

    def _adopt(self) -> None:
        """A new holder serves what the document says before it writes it: a front end that just joined
        (a new pod, one started again elsewhere) serves its config's versions, not those the server rolled
        to, and must not write those over the server's."""
        updates = self.server.fleet.updates()
        for model, ms in sorted(self.state.models.items()):
            if model in self.server.registry and model not in updates:
                self._follow(model, ms)

    def _settle(self) -> None:
        """A new holder: end the updates the document says run and nobody here runs, where their
        default was (past the first new worker: finished; before it: undone)."""
        updates = self.server.fleet.updates()
        registry = self.server.registry
        for model, ms in self.state.models.items():
            if not ms.updating or model in updates or model not in registry:
                continue
            old, new, _ = ms.updating
            dropped = old if ms.default == new else new
            if dropped in registry.versions(model) and ms.default in registry.versions(model):
                registry.set_default(model, ms.default)
                self.server.fleet.move_slots(model, dropped, ms.default)
                self.server.remove_version(model, dropped)
                log.info("model %s: the update %d -> %d the last holder left ends at %d", model, old, new, ms.default)

    # ---- the holder, during a rolling update (fleet/control.py's Followers) ---------------------------
    async def until_serving(self, model: str, version: int) -> None:
        """Write that `version` is served, then wait until every live front end serves it; Conflict when
        one does not within wait_s (nothing changed), ClusterUnavailable when the store fails."""
        with changes():
            self.check_holder()
            await self.publish()
            behind = names(await self.reports.until(lambda r: version not in r.of(model).versions, self.wait_s))
            if self.refresh_members is not None:
                await self.refresh_members()
        if behind:
            raise Conflict(
                f"front end(s) {behind} do not serve version {version} of {model!r} (see their logs: it "
                "must load from the model repository there too); nothing was changed"
            )

    async def until_moved(self, model: str, old: int, new: int) -> None:
        """Write the new default, then wait until the live front ends send new requests to `new` and
        hold no work of `old` (at most wait_s)."""
        with changes():
            self.check_holder()
            await self.publish()
            behind = names(
                await self.reports.until(lambda r: r.of(model).default != new or old in r.of(model).busy, self.wait_s)
            )
        if behind:
            log.warning("model %s: front end(s) %s still use version %d; its last worker drains anyway", model, behind, old)

    async def until_refused(self, model: str) -> None:
        """Write that `model` is unloaded, then wait until the live front ends refuse it and hold none of
        its work (at most wait_s; then it goes on)."""
        await self._until_control(model, lambda r: r.unloaded.get(model, True), "still hold work of")

    async def until_served(self, model: str) -> None:
        """Write that `model` is served again, then wait until no live front end refuses it (at most wait_s)."""
        await self._until_control(model, lambda r: model in r.unloaded, "still refuse")

    async def _until_control(self, model: str, lagging: Callable[[Serving], bool], what: str) -> None:
        with changes():
            self.check_holder()
            await self.publish()
            behind = names(await self.reports.until(lagging, self.wait_s))
        if behind:
            log.warning("model %s: front end(s) %s %s it after %g s; going on", model, behind, what, self.wait_s)


def _always() -> bool:
    return True


def _holds_work(rt: Any) -> bool:
    stats = rt.statistics()
    return stats.queued > 0 or stats.in_flight > 0

