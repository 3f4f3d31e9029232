"""What the owner serves, kept in the parent's folder, so that an owner the parent starts again serves it.

The versions of a model change at runtime (a rolling update, a rollback: fleet/control.py) while the
config file still names the version the server started with. With several front ends the owner can die
and be started again by the parent while the server goes on; without this file it would come back
serving the config's versions, turn away the workers of the version it had rolled to, and take the
followers back with it: a finished update silently undone.

So the owner writes what it serves (each model's versions, default version and live worker slots, for
the kinds with workers: version_sync's view) to `served.json` in the parent's folder whenever that
changes (looked at every SYNC_INTERVAL_S). The folder outlives the owner and is removed with the server,
so only an owner of the same server reads it. Where what was saved differs from the config's versions,
`restore` turns the config's models into the saved versions (loaded from the model repository, as the
update loaded them) with the saved default, and gives each version the saved slots, at the same indexes:
each slot adopts its surviving worker (worker/survivors.py) or starts one. A finished update stays
finished, with the capacity it had; one in progress is not resumed: both versions go on serving, with
the workers each had, until it is run again. A server started afresh has a new folder and serves its
config.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from inferd.config import ConfigError, ModelConfig
from inferd.frontends.plan import FrontendPlan

if TYPE_CHECKING:
    from inferd.runtime.registry import ModelRegistry
    from inferd.worker.launcher import Launcher

log = logging.getLogger("inferd.frontends")


class SavedModel(msgspec.Struct, frozen=True):
    versions: list[int]
    default: int
    slots: dict[int, list[int]] = {}
    """Version -> the indexes of its live worker slots (worker ids MODEL-INDEX)."""


def save(path: Path, models: dict[str, SavedModel]) -> None:
    """Replace the file at once (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(msgspec.json.encode(models))
    os.replace(tmp, path)


def load(path: Path) -> dict[str, SavedModel]:
    """What a previous owner saved; {} when none did (a server's first owner) or the file is unreadable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        return msgspec.json.decode(raw, type=dict[str, SavedModel])
    except msgspec.DecodeError as exc:
        log.error("%s is not what an owner front end writes (%s): serving the config's versions", path, exc)
        return {}


class Restored(msgspec.Struct, frozen=True):
    models: list[ModelConfig]
    defaults: dict[str, int] = {}
    """Each restored model's default version."""
    slots: dict[tuple[str, int], list[int]] = {}
    """(model, version) -> its worker slots' indexes, for every version of a restored model."""

    def set_defaults(self, registry: ModelRegistry) -> None:
        for name, version in self.defaults.items():
            registry.set_default(name, version)

    def add_slots(self, launcher: Launcher[Any], local: list[tuple[ModelConfig, int]]) -> None:
        """The worker slots: the saved ones of a restored version, else the config's count."""
        for m, n in local:
            at = self.slots.get((m.name, m.version))
            if at is None:
                launcher.add(m.name, n, m.version)
            else:
                launcher.add_at(m.name, m.version, at)


def restore_for(
    plan: FrontendPlan | None,
    models: list[ModelConfig],
    load_version: Callable[[str, int | None], ModelConfig] | None,
) -> Restored:
    """`restore` for the owner of several front ends, from its folder's file; the config's models as they
    are for the only front end and for the followers (they follow the owner: version_sync.py)."""
    if plan is None or not plan.is_owner:
        return Restored(models)
    return restore(models, load(Path(plan.served_path())), load_version)


def restore(
    models: list[ModelConfig],
    saved: dict[str, SavedModel],
    load_version: Callable[[str, int | None], ModelConfig] | None,
) -> Restored:
    """The config's `models`, with each model whose saved versions differ from the config's served as
    saved instead. One whose saved versions cannot all be loaded (no repository, a version removed from
    it) keeps the config's."""
    by_name: dict[str, list[ModelConfig]] = {}
    for m in models:
        by_name.setdefault(m.name, []).append(m)
    out: list[ModelConfig] = []
    defaults: dict[str, int] = {}
    slots: dict[tuple[str, int], list[int]] = {}
    for name, configs in by_name.items():
        s = saved.get(name)
        if s is None or (sorted(s.versions), s.default) == _as_configured(configs):
            out += configs  # as configured (the survivors keep the slots added since)
            continue
        loaded = _load(name, s, {c.version: c for c in configs}, load_version)
        if loaded is None:
            out += configs
            continue
        out += loaded
        defaults[name] = s.default
        slots |= {(name, v): s.slots.get(v, []) for v in s.versions}
        log.info(
            "model %s: serving version(s) %s (default %d) with worker slots %s, as the previous owner "
            "front end did, not the config's version(s) %s",
            name,
            s.versions,
            s.default,
            {v: s.slots.get(v, []) for v in s.versions},
            [c.version for c in configs],
        )
    return Restored(out, defaults, slots)


def _as_configured(configs: list[ModelConfig]) -> tuple[list[int], int]:
    """(versions, default version) as the registry serves the config's: a pinned default, else the highest."""
    versions = sorted(c.version for c in configs)
    pinned = [c.default_version for c in configs if c.default_version is not None]
    return versions, pinned[-1] if pinned else versions[-1]


def _load(
    name: str,
    s: SavedModel,
    configured: dict[int, ModelConfig],
    load_version: Callable[[str, int | None], ModelConfig] | None,
) -> list[ModelConfig] | None:
    if s.default not in s.versions:
        log.error("model %s: the saved default %d is not among its versions %s", name, s.default, s.versions)
        return None
    out = []
    for version in s.versions:
        if version in configured:
            out.append(configured[version])
            continue
        if load_version is None:
            log.error(
                "model %s: the previous owner front end served version %d, but there is no model "
                "repository (--model-repo): serving the config's versions",
                name,
                version,
            )
            return None
        try:
            out.append(load_version(name, version))
        except (ConfigError, ValueError, OSError) as exc:
            log.error(
                "model %s: cannot load version %d, which the previous owner front end served: %s; "
                "serving the config's versions",
                name,
                version,
                exc,
            )
            return None
    return out
