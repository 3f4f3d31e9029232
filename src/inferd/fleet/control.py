"""Changing the fleet while it serves, for every kind with workers (batch, llm):

- scale a model version's local workers up or down (scale-down drains first: no request fails);
- roll a model to any version, lower included (rollback), worker by worker: the new version gets its
  own runtime (its own batching policy, queue and recovery settings), the default version flips only
  once a new-version worker is ready, each old worker is drained only after a new one is up, and the
  old version is retired once it holds no work.

It reaches the fleet through the registry, the runtimes' contract and snapshots, the server's
WorkerDirectory (which workers each version has; runtime/membership.py), and the launcher.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from inferd.config import MAX_WORKERS, ConfigError, ModelConfig
from inferd.errors import BadRequest, NotFound
from inferd.kinds.repository import apply_overrides, load_model_version
from inferd.runtime.contract import Runtime
from inferd.runtime.membership import WorkerDirectory
from inferd.runtime.registry import ModelRegistry
from inferd.wire.connection import WorkerConnection, WorkerState, slot_of
from inferd.worker.launcher import Launcher, WorkerSlot

log = logging.getLogger("inferd.fleet")

MAX_LOCAL_WORKERS = MAX_WORKERS
"""The most local workers of one model version (`scale_to`)."""

VersionLoader = Callable[[str, int | None], ModelConfig]
"""(model, version or None for the highest) -> that version's config, from the model repository."""


class VersionHost(Protocol):
    """What serves versions (the server): start and stop one version's runtime."""

    def add_version(self, config: ModelConfig) -> Runtime: ...

    def remove_version(self, name: str, version: int) -> None: ...

    def has_workers(self, kind: str) -> bool: ...


class Followers(Protocol):
    """The other front ends (cluster/served.py, over the served state): their workers are ours, so
    they must serve a version before its workers start, and leave the old one before it goes."""

    async def until_serving(self, model: str, version: int) -> None:
        """Until they serve `version` (raises when they do not: the update is refused)."""
        ...

    async def until_moved(self, model: str, old: int, new: int) -> None:
        """Until they send new requests to `new` and hold no work of `old` (bounded)."""
        ...


class FleetControl:
    def __init__(
        self,
        registry: ModelRegistry,
        launcher: Launcher[Any],
        host: VersionHost,
        directory: WorkerDirectory,
        load_version: VersionLoader | None = None,
        ready_timeout_s: float = 120.0,
        followers: Followers | None = None,
        gate: Callable[[], None] | None = None,
    ) -> None:
        self.registry = registry
        self.launcher = launcher
        self.host = host
        self.directory = directory
        self.load_version = load_version
        self.ready_timeout_s = ready_timeout_s
        self.followers = followers
        """The other front ends (None: none to wait for)."""
        self.gate = gate
        """Called before a change (scale, update): raises when this front end may not change the fleet
        now (it does not hold the lease: cluster/lease.py)."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._updating: dict[str, tuple[int, int, int]] = {}
        """Model -> (old version, new version, workers) while its rolling update runs."""

    def updates(self) -> dict[str, tuple[int, int, int]]:
        """The rolling updates running: model -> (old version, new version, old workers to replace)."""
        return dict(self._updating)

    def local_workers(self, model: str, version: int | None = None) -> int:
        rt = self.registry.get(model, version)
        return len(self.launcher.live_slots(model, rt.version))

    async def scale_to(self, model: str, workers: int, version: int | None = None) -> int:
        """Set the number of local workers of a version (default: the default version); removed ones are
        drained (they finish what they hold)."""
        rt = self._with_workers(model, version)
        self._may_change()
        if not 0 <= workers <= MAX_LOCAL_WORKERS:
            raise BadRequest(f"workers must be within 0..{MAX_LOCAL_WORKERS}, got {workers}")
        async with self._lock(model):
            live = self.launcher.live_slots(model, rt.version)
            if workers > len(live):
                self.launcher.add(model, workers - len(live), rt.version)
                log.info(
                    "model %s v%d: scaling up from %d to %d local workers",
                    model,
                    rt.version,
                    len(live),
                    workers,
                )
            elif workers < len(live):
                victims = _least_loaded(rt, live)[: len(live) - workers]
                log.info(
                    "model %s v%d: scaling down from %d to %d local workers (draining %s)",
                    model,
                    rt.version,
                    len(live),
                    workers,
                    [s.worker_id for s in victims],
                )
                for slot in victims:
                    self._retire(rt, slot)
            return workers

    def move_slots(self, model: str, version: int, default: int) -> int:
        """This front end stops serving `version` though it did not roll it (the server's holder did, or
        a new holder settles what the last one left): its local slots of that version move to the
        `default` version, as many (their workers, told their version is retired, exit and are not
        restarted; the new ones join at `default`). Returns how many moved."""
        slots = self.launcher.live_slots(model, version)
        for slot in slots:
            self.launcher.retire(slot)
        if slots and default != version:
            self.launcher.add(model, len(slots), default)
            log.info("model %s: %d local worker(s) of version %d move to version %d", model, len(slots), version, default)
        return len(slots)

    async def rolling_update(self, model: str, version: int | None = None) -> dict[str, Any]:
        """Make `version` (None: the repository's highest) the model's default version, replacing the
        current default version's workers one by one. A version already served side by side becomes
        the default at once."""
        old = self._with_workers(model, None, pooled=True)
        self._may_change()
        if version is not None and version in self.registry.versions(model):
            self.registry.set_default(model, version)
            log.info("model %s: default version %d -> %d (already served)", model, old.version, version)
            return {"model": model, "from": old.version, "to": version, "replaced": 0}
        new_config = self._load_config(model, version)
        if new_config.version == old.version:
            return {"model": model, "from": old.version, "to": old.version, "replaced": 0}
        if new_config.kind != old.kind:
            raise BadRequest(
                f"version {new_config.version} of {model!r} is a {new_config.kind} model, but version "
                f"{old.version} is a {old.kind} model; a rolling update keeps the kind (restart instead)"
            )
        if (new_config.pool is None) != (old.config.pool is None):
            raise BadRequest(
                f"version {new_config.version} of {model!r} has pool = {new_config.pool!r}, but version "
                f"{old.version} has pool = {old.config.pool!r}; a rolling update keeps how it is served (restart instead)"
            )
        async with self._lock(model):
            roll = self._roll_pooled if old.config.pool is not None else self._roll
            replaced = await roll(model, old, new_config)
        return {"model": model, "from": old.version, "to": new_config.version, "replaced": replaced}

    async def _roll(self, model: str, old: Runtime, config: ModelConfig) -> int:
        self.registry.set_default(model, old.version)  # pinned: the new version is not the default yet
        new = self.host.add_version(config)
        old_slots = list(self.launcher.live_slots(model, old.version))
        self._updating[model] = (old.version, new.version, len(old_slots))
        log.info(
            "model %s: rolling update v%d -> v%d over %d worker(s)",
            model,
            old.version,
            new.version,
            len(old_slots),
        )
        try:
            if self.followers is not None:  # a worker of a version a front end lacks is turned away
                await self.followers.until_serving(model, new.version)
            for index, slot in enumerate(old_slots or [None]):
                self._may_change()  # each step: a holder whose lease lapsed stops; the next one settles it
                (fresh,) = self.launcher.add(model, 1, new.version)
                await self._wait_ready(new, fresh)
                self._may_change()
                if index == 0:  # a new-version worker is ready: new requests go to it from now on
                    self.registry.set_default(model, new.version)
                if slot is None:
                    continue
                if index == len(old_slots) - 1:
                    if self.followers is not None:
                        await self.followers.until_moved(model, old.version, new.version)
                    await self._wait_idle(old)  # the last old worker answers what the old version holds
                self._retire(old, slot)
                await self._wait_gone(old, slot)
            if not old_slots:  # no local worker of the old version (workers on other hosts serve it)
                if self.followers is not None:
                    await self.followers.until_moved(model, old.version, new.version)
                await self._wait_idle(old)  # its workers answer what it holds before it goes
        except BaseException:
            if self.registry.default_version(model) != new.version:
                self.host.remove_version(model, new.version)  # never served: nothing to hand over
            raise
        finally:
            del self._updating[model]
        self.host.remove_version(model, old.version)
        return len(old_slots)

    async def _roll_pooled(self, model: str, old: Runtime, config: ModelConfig) -> int:
        """A pooled model has no workers of its own to replace: the new version is served at once (its
        pool loads it on demand) and becomes the default; the old one answers what it holds, then goes
        (its pool's workers unload it: `InferenceServer.remove_version`)."""
        new = self.host.add_version(config)
        if self.followers is not None:
            await self.followers.until_serving(model, new.version)
        self.registry.set_default(model, new.version)
        if self.followers is not None:
            await self.followers.until_moved(model, old.version, new.version)
        await self._wait_idle(old)
        self.host.remove_version(model, old.version)
        return 0

    def _may_change(self) -> None:
        """Raises when this front end may not change the fleet now (`gate`)."""
        if self.gate is not None:
            self.gate()

    def _load_config(self, model: str, version: int | None) -> ModelConfig:
        if self.load_version is None:
            raise BadRequest("the server runs without --model-repo: there is no other version to load")
        try:
            return self.load_version(model, version)
        except ConfigError as exc:
            raise BadRequest(f"cannot load version {version} of model {model!r}: {exc}") from None

    def _with_workers(self, model: str, version: int | None, pooled: bool = False) -> Runtime:
        """The model's runtime, when it has workers of its own (`pooled`: or is served by a pool)."""
        rt = self.registry.get(model, version)
        if not self.host.has_workers(rt.kind):
            raise BadRequest(f"model {model!r} is a {rt.kind} model: it has no workers to scale or update")
        if rt.config.pool is not None and not pooled:
            raise BadRequest(
                f"model {model!r} is served by pool {rt.config.pool!r}: it has no workers of its own to "
                f"scale (its pool's workers load it on demand: set workers in [pools.{rt.config.pool}])"
            )
        return rt

    def _retire(self, rt: Runtime, slot: WorkerSlot) -> None:
        self.launcher.retire(slot)
        worker = self._worker(rt, slot)
        if worker is not None:
            rt.drain_worker(worker)
        elif slot.process is not None and slot.process.returncode is None:
            slot.process.terminate()  # still starting: nothing to drain

    async def _wait_ready(self, rt: Runtime, slot: WorkerSlot) -> None:
        async with asyncio.timeout(self.ready_timeout_s):
            while True:
                w = self._worker(rt, slot)
                if w is not None and w.state is WorkerState.READY:
                    return
                await self.directory.changed(rt.name, rt.version)

    async def _wait_gone(self, rt: Runtime, slot: WorkerSlot) -> None:
        async with asyncio.timeout(self.ready_timeout_s):
            while self._worker(rt, slot) is not None:
                await self.directory.changed(rt.name, rt.version)

    async def _wait_idle(self, rt: Runtime, poll_s: float = 0.05) -> None:
        """Until the runtime holds no queued or running work (bounded by ready_timeout_s)."""
        async with asyncio.timeout(self.ready_timeout_s):
            while True:
                stats = rt.statistics()
                if stats.queued == 0 and stats.in_flight == 0:
                    return
                await asyncio.sleep(poll_s)

    def _worker(self, rt: Runtime, slot: WorkerSlot) -> WorkerConnection | None:
        workers = self.directory.workers(rt.name, rt.version)
        return next((w for w in workers if w.slot_id == slot.worker_id), None)

    def _lock(self, model: str) -> asyncio.Lock:
        if model not in self.registry:
            raise NotFound(f"unknown model {model!r}; served models: {self.registry.names()}")
        return self._locks.setdefault(model, asyncio.Lock())


def _least_loaded(rt: Runtime, slots: list[WorkerSlot]) -> list[WorkerSlot]:
    """Slots by what their workers hold, from one snapshot: still-starting ones first, newest first."""
    loads = {slot_of(w.worker_id): w.load for w in rt.statistics().workers}

    def key(slot: WorkerSlot) -> tuple[int, int]:
        load = loads.get(slot.worker_id)
        return (0, -slot.index) if load is None else (1 + load, -slot.index)

    return sorted(slots, key=key)


def repository_loader(repo: Path, overrides: dict[str, dict[str, Any]]) -> VersionLoader:
    """Load any version of a model from the repository, with the config file's [models.NAME] overrides."""

    def load(model: str, version: int | None) -> ModelConfig:
        (config,) = apply_overrides(
            [load_model_version(repo / model, version)], {k: v for k, v in overrides.items() if k == model}
        )
        return config

    return load
