"""`--model-control poll`: the repository folder read every `repository_poll_s`, off the event loop (what
changed: fleet/repository_watch.py), and its changes applied through model control's own load and unload
(fleet/model_control.py): a model's new version served (a rolling update), a new model folder served, a
removed one unloaded (served again once its folder is back; an operator's unload is not), and a folder
that does not load leaves what serves and is reported (in the log once, and in the index's reason).
With several front ends the holder of the `decider` lease polls for the server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from inferd.config import ModelConfig, ServerConfig
from inferd.errors import ServingError
from inferd.fleet.control_share import Others
from inferd.fleet.repository_index import REMOVED, UNLOADED
from inferd.fleet.repository_watch import RepositoryWatch, fingerprints

log = logging.getLogger("inferd.fleet")


class Polled(Protocol):
    """What of `ModelControl` the poll reads and drives."""

    config: ServerConfig
    host: Any
    others: Others | None
    unloaded: dict[str, str]
    broken: dict[str, str]

    def read(self, name: str) -> list[ModelConfig]: ...

    async def load(self, name: str) -> None: ...

    async def unload(self, name: str) -> None: ...


class RepositoryPoll:
    def __init__(self, control: Polled, repo: Path) -> None:
        self.control = control
        self.repo = repo

    async def run(self) -> None:
        """Until cancelled: every repository_poll_s, the folder's changes applied."""
        control, repo, only = self.control, self.repo, self.control.config.models
        watch = RepositoryWatch(await asyncio.to_thread(fingerprints, repo, only))
        log.info("model control poll: watching %s every %g s", repo, control.config.repository_poll_s)
        while True:
            await asyncio.sleep(control.config.repository_poll_s)
            if control.others is not None and not control.others.holds():
                continue  # the holder polls for the server
            changes = watch.update(await asyncio.to_thread(fingerprints, repo, only))
            for name in changes.removed:
                if name in control.host.registry:
                    log.info("model %s: its folder left the repository: unloading it", name)
                    await self._polled(name, self._removed)
            for name in (*changes.added, *changes.changed):
                await self._polled(name, self._changed)

    async def _removed(self, name: str) -> None:
        await self.control.unload(name)
        self.control.unloaded[name] = REMOVED  # served again if its folder comes back (an operator's unload is not)

    async def _changed(self, name: str) -> None:
        control = self.control
        try:
            configs = control.read(name)
        except ServingError as exc:
            if control.broken.get(name) != exc.message:
                log.error("model %s: its repository folder does not load, what it serves stays: %s", name, exc.message)
            control.broken[name] = exc.message
            return
        control.broken.pop(name, None)
        registry = control.host.registry
        served = name in registry and configs[0].version != registry.default_version(name)
        if served or (name not in registry and control.unloaded.get(name) != UNLOADED):  # a new version, a new model
            log.info("model %s: version %d in the repository: loading it", name, configs[0].version)
            await control.load(name)

    async def _polled(self, name: str, act: Callable[[str], Awaitable[None]]) -> None:
        """One model's change, logged when it fails (the poll goes on with the others)."""
        try:
            await act(name)
        except ServingError as exc:
            log.error("model %s: the repository's change was not applied: %s", name, exc.message)
        except Exception:  # a model's own code (its load): the poll goes on
            log.exception("model %s: the repository's change was not applied", name)
