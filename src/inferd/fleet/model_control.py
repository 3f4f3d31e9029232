"""Model control (Triton's repository extension): which models of the repository are served, changed
while the server runs.

- **At start** (`ServerConfig.model_control`): "none" and "poll" serve every model; "explicit" only
  those `load_model` names ("*": all). The others are in the index as UNAVAILABLE ("not loaded").
- **Unload** refuses the model's new requests at once (404 saying it is unloaded, and how to load it),
  lets what it holds finish (the requests that passed the check before, `hold` to `release`, even one
  still sending its body; its queue empties, its workers drain: FleetControl.scale_to 0; a pooled
  model's holders are told to unload), then stops serving it (what its queue holds past the bounded
  wait gets that 404 too). It no longer holds the server's readiness down: it is not in the registry. One that
  fails before it stopped anything (with several front ends, the store did not take it) is rolled back:
  the model serves on, as the 503 says.
- **Load** re-reads the model's folder from the repository (the config file's [models.NAME] overrides
  applied), serves it, starts its local workers and answers once one is ready (else a 503 naming why,
  and the model stays unloaded); a pooled model is served on demand, READY at once. A model already
  served is rolled to the repository's version (FleetControl.rolling_update). A load asked while one
  runs joins it (the same answer). Unknown models: 404.
- **Poll** (fleet/repository_poll.py) drives the same load and unload from the folder's changes.

Several front ends: the `decider` lease's holder loads and unloads, the others follow (fleet/control_share.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from inferd.config import ConfigError, ModelConfig, ServerConfig
from inferd.errors import BadRequest, Internal, NotFound, ServingError, ShuttingDown, WorkerUnavailable
from inferd.fleet.control import FleetControl
from inferd.fleet.control_share import ControlFollower, Others, holds_work
from inferd.fleet.pools import ServerPools, check_pooled
from inferd.fleet.repository_index import (
    NOT_LOADED,
    UNLOADED,
    IndexRow,
    ModelState,
    index_rows,
    unloaded_error,
)
from inferd.fleet.repository_poll import RepositoryPoll
from inferd.fleet.repository_watch import model_folder
from inferd.kinds.repository import apply_overrides, load_model_folder
from inferd.runtime.contract import Runtime
from inferd.runtime.kinds import KindRegistry
from inferd.runtime.registry import ModelRegistry
from inferd.wire.connection import WorkerState

log = logging.getLogger("inferd.fleet")


class ControlHost(Protocol):
    """What serves versions (the server)."""

    registry: ModelRegistry
    kinds: KindRegistry
    fleet: FleetControl
    pools: ServerPools
    """The pools (fleet/pools.py): a pooled model is served on demand by its pool's workers."""

    def add_version(self, config: ModelConfig) -> Runtime: ...

    def remove_version(self, name: str, version: int, why: ServingError | None = None) -> None: ...


class ModelControl:
    def __init__(self, host: ControlHost, config: ServerConfig, others: Others | None = None) -> None:
        self.host = host
        self.config = config
        self.repo: Path | None = config.model_repo
        self.others = others  # the other front ends (None: none): the lease's holder acts, they follow
        self.loading_elsewhere: frozenset[str] = frozenset()  # what the holder loads now (its document)
        self.ready_timeout_s = config.worker_start_timeout_s
        self.at_start: dict[str, list[ModelConfig]] = {}
        """The models of the start's list: what a load serves when there is no repository folder."""
        self.unloaded: dict[str, str] = {}
        """Model -> why it is not served (UNLOADED, NOT_LOADED, REMOVED, a failed load's cause); a model
        here while it loads or unloads holds no readiness down (the server's `ready`)."""
        self.broken: dict[str, str] = {}
        """Model -> why its repository folder does not load now (poll), while its old version serves on."""
        self._held: dict[str, int] = {}
        """Model -> its requests between the unloaded check and their answer (`hold`, `release`)."""
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._unloading: dict[str, asyncio.Future[None]] = {}
        self._tg: asyncio.TaskGroup | None = None

    # ---- at start -------------------------------------------------------------------------------------
    def at_start_models(self, models: list[ModelConfig]) -> list[ModelConfig]:
        """The models served at start, of `models` (every version of each): all, or with "explicit"
        those `load_model` names. ConfigError for a name that is not among them."""
        for m in models:
            self.at_start.setdefault(m.name, []).append(m)
        if self.config.model_control != "explicit" or "*" in self.config.load_model:
            return models
        unknown = sorted(set(self.config.load_model) - set(self.at_start))
        if unknown:
            raise ConfigError(f"--load-model names unknown models {unknown}; the repository's: {sorted(self.at_start)}")
        for name in sorted(set(self.at_start) - set(self.config.load_model)):
            self.unloaded[name] = NOT_LOADED
        log.info("model control explicit: serving %s at start; not loaded: %s", sorted(self.config.load_model), sorted(self.unloaded))
        return [m for m in models if m.name in self.config.load_model]

    async def run(self) -> None:
        """Until cancelled: own the loads and unloads running, and poll the repository ("poll")."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            try:
                if self.config.model_control == "poll" and self.repo is not None:
                    await RepositoryPoll(self, self.repo).run()
                await asyncio.Event().wait()
            finally:
                self._tg = None

    # ---- what is served -------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every model the server may serve: those served, and the repository's (loaded or not)."""
        return sorted({*self.host.registry.names(), *self.repository_names()})

    def repository_names(self) -> list[str]:
        if self.repo is None or not self.repo.is_dir():
            return sorted(self.at_start)
        found = [d.name for d in self.repo.iterdir() if not d.name.startswith(".") and model_folder(d)]
        return sorted(n for n in found if not self.config.models or n in self.config.models)

    def refuse_unloaded(self, name: str) -> None:
        """Raises when `name` is a model of the repository that is not served now: loading (503), or
        unloaded (404 saying so, and how to load it). A served model being reloaded serves on."""
        why = self.unloaded.get(name)
        if why is None:
            return
        if name in self._loading or name in self.loading_elsewhere:
            raise WorkerUnavailable(f"model {name!r} is loading: send its requests once its load has answered")
        raise unloaded_error(name, why)

    def hold(self, name: str) -> None:
        """A request of `name` passed the unloaded check (`Api.check_served`): it is the model's work
        until `release` (once answered), so an unload waits for it (a body still being sent, say)."""
        self._held[name] = self._held.get(name, 0) + 1

    def release(self, name: str) -> None:
        left = self._held[name] - 1
        if left:
            self._held[name] = left
        else:
            del self._held[name]

    def held(self, name: str) -> bool:
        """Whether requests of `name` that passed the unloaded check are not answered yet."""
        return name in self._held

    def index(self, visible: Callable[[str], bool], ready_only: bool = False) -> list[IndexRow]:
        """The repository index (fleet/repository_index.py): every model `visible` to the caller."""
        loading = {*self._loading, *self.loading_elsewhere}
        rows = index_rows(
            self.names(), self.host.registry, self.unloaded, self.broken, loading, visible, self.host.pools.unready
        )
        return [r for r in rows if r.state is ModelState.READY or not ready_only]

    # ---- load and unload ------------------------------------------------------------------------------
    async def load(self, name: str) -> None:
        """Serve `name` from the repository (a load already running: join it). Answers once served."""
        self._may_change()
        if (pending := self._unloading.get(name)) is not None:
            with contextlib.suppress(ServingError):
                await asyncio.shield(pending)
        if (running := self._loading.get(name)) is None:
            configs = self.read(name)
            running = self._loading[name] = self._spawn(self._load(name, configs), f"load-{name}")
            running.add_done_callback(lambda _: self._loading.pop(name, None))
        await asyncio.shield(running)

    async def unload(self, name: str) -> None:
        """Stop serving `name` once what it holds is answered (an unload already running: join it)."""
        self._may_change()
        if (pending := self._loading.get(name)) is not None:
            with contextlib.suppress(ServingError):
                await asyncio.shield(pending)
        if (running := self._unloading.get(name)) is None:
            if name not in self.host.registry:
                if name in self.unloaded or name in self.repository_names():
                    return  # not served: nothing to do
                raise NotFound(f"unknown model {name!r}; the repository's models: {self.names()}")
            self._check_kind(self.host.registry.get(name).kind, name)
            before, self.unloaded[name] = self.unloaded.get(name), UNLOADED  # its new requests: 404 from now on
            running = self._unloading[name] = self._spawn(self._unload(name, before), f"unload-{name}")
            running.add_done_callback(lambda _: self._unloading.pop(name, None))
        await asyncio.shield(running)

    def read(self, name: str) -> list[ModelConfig]:
        """The model's served versions as the repository holds them now (NotFound, BadRequest)."""
        if self.repo is None:
            if name not in self.at_start:
                raise NotFound(f"unknown model {name!r}; the server's models: {self.names()}")
            return self.at_start[name]
        if name not in self.repository_names():
            raise NotFound(f"unknown model {name!r}; the repository's models: {self.repository_names()}")
        try:
            configs = load_model_folder(self.repo / name)
            overrides = {k: v for k, v in self.config.model_overrides.items() if k == name}
            configs = apply_overrides(configs, overrides)
            for c in configs:
                self.host.kinds.check(c)
            check_pooled(configs, self.config)  # its pool exists, and its memory_mb fits its budget
        except (ConfigError, ValueError, OSError) as exc:  # OSError: a folder the server may not read
            raise BadRequest(f"cannot load model {name!r}: {exc}") from None
        self._check_kind(configs[0].kind, name)
        for c in configs:  # a pooled model bigger than every worker of its pool: 400 with the sizes
            manager = self.host.pools.manager_for(c)
            if manager is not None and (why := manager.load_refusal(c)) is not None:
                raise BadRequest(f"cannot load model {name!r}: {why}")
        return configs

    def _check_kind(self, kind: str, name: str) -> None:
        """Only the kinds that roll versions (batch, llm, upstream) load and unload here: a search index
        has its own API (docs/search.md)."""
        if not self.host.kinds.get(kind).rolls_versions:
            raise BadRequest(f"model {name!r} is a {kind} model: it is not loaded nor unloaded through the repository API")

    async def _load(self, name: str, configs: list[ModelConfig]) -> None:
        host = self.host
        if name in host.registry:  # served: roll it to the repository's version
            if host.kinds.get(host.registry.get(name).kind).has_workers:
                await host.fleet.rolling_update(name, configs[0].version)
            self.unloaded.pop(name, None)
            return
        self.unloaded.setdefault(name, NOT_LOADED)  # new to the server: LOADING, holds no readiness down
        added = []
        try:
            for config in _default_first(configs):
                added.append(host.add_version(config))
            if self.others is not None:  # served by every front end before its workers join them
                for rt in added:
                    await self.others.until_serving(name, rt.version)
            default = host.registry.get(name)
            if self.host.pools.manager_for(default.config) is not None:
                log.info("model %s: loaded (pooled: served on demand)", name)
            elif host.kinds.get(default.kind).has_workers:
                for rt in added:
                    if self._workers(rt.config):
                        host.fleet.launcher.add(name, self._workers(rt.config), rt.version)
                if self._workers(default.config):  # else workers on other hosts join it when they will
                    await self._until_ready(default)
        except BaseException as exc:
            await self._stop(name, [rt.version for rt in added], drain=False)
            if isinstance(exc, ServingError):  # the index says why it is not served
                self.unloaded[name] = f"its last load failed: {exc.message}"
            raise
        self.unloaded.pop(name, None)
        self.broken.pop(name, None)
        log.info("model %s: loaded, versions %s", name, [rt.version for rt in added])
        if self.others is not None:  # answered once every front end serves it
            await self.others.until_served(name)

    async def _unload(self, name: str, before: str | None) -> None:
        """Drain and stop `name` (marked unloaded). A failure before any of its workers was told to stop
        (the store did not take the mark or the wait; the fleet refused its first scale-down) rolls the
        mark back: it serves on, as its 503 says. One after leaves it unloaded; an unload again ends it."""
        stopping: list[int] = []
        try:
            if self.others is not None:  # every front end refuses it first, and holds none of its work
                await self.others.until_refused(name)
            await self._stop(name, self.host.registry.versions(name), drain=True, stopping=stopping)
        except BaseException:
            if not stopping and self.unloaded.get(name) == UNLOADED:
                self._serve_on(name, before)
            raise
        log.info("model %s: unloaded", name)

    def _serve_on(self, name: str, before: str | None) -> None:
        if before is None:
            del self.unloaded[name]
        else:
            self.unloaded[name] = before
        log.warning("model %s: its unload failed before it stopped anything: it serves on", name)

    async def _stop(self, name: str, versions: list[int], drain: bool, stopping: list[int] | None = None) -> None:
        """Stop serving these versions: (`drain`) once the model holds no work (its requests past the
        unloaded check answered, its queues empty), their workers drained; what is left then (past the
        bounded waits) is refused as unloaded. `stopping`: the versions whose workers were told to stop."""
        host = self.host
        for version in versions:
            rt = host.registry.get(name, version)
            if drain:
                await self._until(lambda rt=rt: not holds_work(rt) and name not in self._held)
            if host.pools.manager_for(rt.config) is not None:  # each holder drains it, then unloads it
                told = host.pools.unload(name, version)
                log.info("model %s v%d: pool worker(s) %s told to unload it", name, version, told)
            elif host.kinds.get(rt.kind).has_workers:
                await host.fleet.scale_to(name, 0, version)
            if stopping is not None:
                stopping.append(version)
            if drain:  # its workers (local, or a pool's model servers) finish what they hold, then leave
                await self._until(lambda rt=rt: not host.fleet.directory.workers(rt.name, rt.version))
            why = unloaded_error(name, self.unloaded.get(name, UNLOADED)) if drain else None
            host.remove_version(name, version, why)

    def _workers(self, config: ModelConfig) -> int:
        """The local workers a version of the model starts with (as at the server's start)."""
        return self.config.workers if config.workers is None else config.workers

    async def _until_ready(self, rt: Runtime) -> None:
        directory = self.host.fleet.directory
        try:
            async with asyncio.timeout(self.ready_timeout_s):
                while not any(w.state is WorkerState.READY for w in directory.workers(rt.name, rt.version)):
                    await directory.changed(rt.name, rt.version)
        except TimeoutError:
            raise WorkerUnavailable(
                f"model {rt.name!r} version {rt.version}: no worker was ready within {self.ready_timeout_s:g} s "
                "(worker_start_timeout_s) of its load; it stays unloaded (see the server's log for its workers)"
            ) from None

    async def _until(self, done: Callable[[], bool], poll_s: float = 0.05) -> None:
        """Until `done()`, at most ready_timeout_s (then on: what is left fails as the version goes)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ready_timeout_s):
                while True:
                    if done():
                        return
                    await asyncio.sleep(poll_s)

    def share(self, others: Others) -> ControlFollower:
        """Several front ends: the others wait on this one's loads and unloads; it follows theirs."""
        self.others = others
        return ControlFollower(self, lambda: sorted(self._loading))

    def _may_change(self) -> None:
        if self.others is not None:  # only the lease's holder (api/repository.py forwards to it)
            self.others.check_holder()
        if self._tg is None:
            raise ShuttingDown("the server is not running: models cannot be loaded nor unloaded now")

    def _spawn(self, work: Awaitable[None], name: str) -> asyncio.Future[None]:
        """Run `work` in the control's task group (it goes on when its callers leave): its outcome as a
        future every caller awaits (shielded)."""
        if self._tg is None:
            raise ShuttingDown("the server is not running: models cannot be loaded nor unloaded now")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: callers may have left

        async def run() -> None:
            try:
                await work
            except asyncio.CancelledError:
                _settle(done, ShuttingDown(f"{name}: the server is stopping"))
                raise
            except ServingError as exc:
                _settle(done, exc)
            except Exception as exc:  # a model's own code: the caller gets a 500, the server serves on
                log.exception("%s failed", name)
                _settle(done, Internal(f"{name} failed: {exc!r}"))
            else:
                _settle(done, None)

        self._tg.create_task(run(), name=f"model-control-{name}")
        return done


def _default_first(configs: list[ModelConfig]) -> list[ModelConfig]:
    """A model's versions in the order a load serves them: the one that will serve by default first (its
    default_version, else the highest: ModelRegistry's rule), so that the scaling loop made as the model
    is served anew (`ScalingLoops.renew`, at its first version) follows that version's [autoscale]."""
    first = next((c for c in configs if c.version == c.default_version), max(configs, key=lambda c: c.version))
    return [first, *(c for c in configs if c is not first)]


def _settle(fut: asyncio.Future[Any], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
