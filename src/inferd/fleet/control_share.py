"""Model control with several front ends (`--frontends N`, a cluster store): one load or unload for the
whole server. The holder of the `decider` lease (cluster/lease.py) carries it out (asked of another
front end, the repository API forwards it there: api/repository.py); every front end follows the served
document (cluster/served.py), which says, beside the served versions, which models of the repository
the server does not serve and why (`unloaded`), and which load now (`loading`).

- **Unload**, on the holder: the model is refused there at once and the document says so; every other
  front end refuses its new requests too (404 "unloaded") and reports once it holds none of its work
  (`refused`); then the holder drains the model's workers and stops serving it, and the others stop
  serving it as the document drops its versions.
- **Load**, on the holder: it serves the model's versions and waits until every live front end serves
  them too (its workers join every front end, and one that does not serve the model turns them away), as
  a rolling update does; the others answer its requests 503 "loading" meanwhile; then its workers
  start, and once one is ready the document drops the model from `unloaded` and every front end answers
  its requests. A front end that cannot serve it fails the load (409 naming it; nothing stays served).

The waits are bounded (cluster/served.py's FOLLOWERS_WAIT_S); a front end that died stops counting once
its report expires.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any, Protocol

from inferd.config import ConfigError, ModelConfig
from inferd.fleet.repository_index import unloaded_error

log = logging.getLogger("inferd.fleet")


class Others(Protocol):
    """The other front ends, over the served document (cluster/served.py `ServedVersions`)."""

    def holds(self) -> bool:
        """This front end decides for the server now (it holds the lease)."""
        ...

    def check_holder(self) -> None:
        """Raises (503) unless this front end decides for the server now."""
        ...

    async def until_serving(self, model: str, version: int) -> None:
        """Write that `version` is served, then until every live front end serves it (Conflict if not)."""
        ...

    async def until_refused(self, model: str) -> None:
        """Write that `model` is unloaded, then until every live front end refuses it and holds none of
        its work (bounded)."""
        ...

    async def until_served(self, model: str) -> None:
        """Write that `model` is served again, then until no live front end refuses it (bounded)."""
        ...


class Controlled(Protocol):
    """What of fleet/model_control.py's `ModelControl` the document's followers read and set."""

    host: Any
    unloaded: dict[str, str]
    loading_elsewhere: frozenset[str]
    at_start: dict[str, list[ModelConfig]]

    def held(self, name: str) -> bool:
        """Requests of `name` past the unloaded check are not answered yet."""
        ...


class ControlFollower:
    """A front end's side of the document's model control (cluster/served.py's `ControlShare`): what the
    holder writes, what every other front end applies, what each reports."""

    def __init__(self, control: Controlled, loading: Callable[[], list[str]]) -> None:
        self.control = control
        self.loading = loading
        """The models this front end loads now."""

    def written(self) -> tuple[dict[str, str], list[str]]:
        """What the holder writes: the models it does not serve (and why), those it loads now."""
        return dict(self.control.unloaded), self.loading()

    def wanted(self, model: str) -> bool:
        """A model the server serves and this front end does not (it is unloaded here): served here too."""
        return model in self.control.unloaded

    def started_with(self, model: str, version: int | None) -> ModelConfig:
        """A version of `model` as this front end started with it: what it serves again when the server
        loads it and there is no model repository here (`--model` on the command line, the config file)."""
        for config in self.control.at_start.get(model, []):
            if version is None or config.version == version:
                return config
        raise ConfigError(f"model {model!r} version {version} is not among the models this front end started with")

    def follow(self, unloaded: dict[str, str], loading: list[str], served: Collection[str]) -> None:
        """Apply the document: refuse the models it says are unloaded (stop serving those whose versions
        it dropped), serve again those it no longer says are."""
        control, registry = self.control, self.control.host.registry
        control.loading_elsewhere = frozenset(loading)
        for name, why in sorted(unloaded.items()):
            if name in registry and name not in control.unloaded:
                log.info("model %s: unloaded by the server (%s): its new requests are refused here", name, why)
            control.unloaded[name] = why
            rolls = name in registry and control.host.kinds.get(registry.get(name).kind).rolls_versions
            if rolls and name not in served:  # the holder stopped serving it (a kind the document lists)
                for version in registry.versions(name):
                    control.host.fleet.move_slots(name, version, version)  # local workers here: not restarted
                    control.host.remove_version(name, version, unloaded_error(name, why))
                log.info("model %s: no longer served here, as the server", name)
        for name in [n for n in control.unloaded if n not in unloaded and n in registry]:
            del control.unloaded[name]
            log.info("model %s: loaded by the server: served here too", name)

    def refused(self) -> dict[str, bool]:
        """This front end's report: the models it refuses, each with whether it holds work here still
        (queued or running, or a request past the unloaded check not answered yet)."""
        control, registry = self.control, self.control.host.registry
        return {
            name: control.held(name) or any(holds_work(registry.get(name, v)) for v in registry.versions(name))
            for name in control.unloaded
        }


def holds_work(rt: Any) -> bool:
    """Whether a runtime holds queued or running work."""
    stats = rt.statistics()
    return stats.queued > 0 or stats.in_flight > 0
