"""What a front end served, kept in the cluster store, so that one started again serves it.

The versions of a model change at runtime (a rolling update, a rollback: fleet/control.py) while the
config file still names the version the server started with. A front end that runs workers (the owner of
`--frontends N`: the holder of the lease) can die and be started again while the server goes on; serving
the config's versions it would turn away the workers of the version it had rolled to, and take the others
back with it: a finished update silently undone.

So the state it serves is in the store, which outlives it (the parent's, with `--frontends N`; Redis
across hosts): each model's versions, default version and the rolling update running, if any, are in
the `served` document (cluster/served.py), and the live worker slots of the front end's own launcher in
`local/<frontend>` (`save`, written when they changed). A front end reads both before it makes its
runtimes and its worker slots (`take`). Each saved model is served as saved (versions loaded from the
model repository, as the update loaded them) with its saved default, and takes back its saved slots at
the same indexes: each adopts its surviving worker (worker/survivors.py) or starts one.

A rolling update that was running is not resumed worker by worker: it ends at once where its default
was (`SavedModel.settled`). Past the first new worker ready (the default moved), the old version is
dropped and its slots come back as new slots of the new version: the update is finished, with the
workers it would have ended with. Before that, the new version is dropped: the update is undone. The
dropped version's surviving workers get SIGTERM (they drain), and the others retire it once the holder
writes the settled state (what they still had queued for it fails with 503). So the state saved a
moment before the update's last step gives the same end as the state after it.

A model whose saved versions cannot be loaded keeps the config's, and so does one the document does not
name. The starts with a saved state are counted (in `local/<frontend>`) until one runs with it (`take`,
`save`): after MAX_STARTS in a row died first (a state that fails the start, say), the next serves the
config's versions. A server started afresh (a new parent, a new cluster name) serves its config.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from inferd.cluster.follower import Document
from inferd.cluster.served import SERVED
from inferd.cluster.store import Store, StoreError
from inferd.config import MAX_WORKERS, ConfigError, ModelConfig

if TYPE_CHECKING:
    from inferd.runtime.registry import ModelRegistry

VersionLoader = Callable[[str, "int | None"], ModelConfig]
"""(model, version) -> that version's config from the model repository (fleet/control.py's loader)."""


class SlotLauncher(Protocol):
    """What of the front end's launcher (worker/launcher.py) a restart's slots use."""

    def add(self, model: str, count: int, version: int | None = None) -> Any: ...

    def add_at(self, model: str, version: int, indexes: list[int]) -> Any: ...

log = logging.getLogger("inferd.cluster")


class SavedModel(msgspec.Struct, frozen=True):
    versions: list[int]
    default: int
    slots: dict[int, list[int]] = {}
    """Version -> the indexes of its live worker slots (worker ids MODEL-INDEX)."""
    updating: list[int] = []
    """[old version, new version, workers] while a rolling update runs (FleetControl.updates); [] else."""

    def problem(self) -> str | None:
        """What makes it unusable (a file no owner wrote), or None."""
        if len(set(self.versions)) != len(self.versions) or self.default not in self.versions:
            return f"versions {self.versions} with default {self.default}"
        if self.updating and not _an_update(self.updating, self.versions, self.default):
            return f"an update {self.updating} of versions {self.versions} with default {self.default}"
        if set(self.slots) - set(self.versions):
            return f"slots {self.slots} of versions {self.versions}"
        indexes = [i for at in self.slots.values() for i in at]
        if len(set(indexes)) != len(indexes) or any(i < 0 for i in indexes):
            return f"slots {self.slots}"
        return None

    def settled(self) -> SavedModel:
        """Without a running update: ended where its default was (see the module's doc)."""
        if not self.updating:
            return self
        old, new, workers = self.updating
        dropped = old if self.default == new else new
        slots = {v: list(at) for v, at in self.slots.items() if v != dropped}
        kept = slots.setdefault(self.default, [])
        fresh = max((i + 1 for at in self.slots.values() for i in at), default=0)  # never a dropped one's id
        while len(kept) < workers:
            kept.append(fresh)
            fresh += 1
        return SavedModel([v for v in self.versions if v != dropped], self.default, slots)


MAX_STARTS = 3
"""Owners in a row that may start with a saved state and die before they run with it (a SIGKILL in that
moment, or a state that fails the start); the next one serves the config's versions."""

LOCAL = "local/"
LOCAL_TTL_S = 3600.0
"""`local/<frontend>` expires unless written again within this long (its front end rewrites it well
before): ids of front ends gone for good (a Kubernetes pod's address) do not pile up in the store. A
front end started again later than that starts its config's workers."""
"""`local/<frontend>`: what one front end's launcher runs (its worker slots), for its restart."""


class LocalSlots(msgspec.Struct, frozen=True):
    """A front end's `local/<frontend>` document: each model's live worker slots by version, and the
    starts counted since one last ran with them (`take`, `save`)."""

    slots: dict[str, dict[int, list[int]]] = {}
    starts: int = 0


def local_doc(frontend: str) -> Document[LocalSlots]:
    return Document(LOCAL + frontend, LocalSlots, LocalSlots)


def _an_update(updating: list[int], versions: list[int], default: int) -> bool:
    """[old, new, workers] as FleetControl.updates gives it: two served versions, one the default."""
    if len(updating) != 3:
        return False
    old, new, workers = updating
    return (
        old != new
        and {old, new} <= set(versions)
        and default in (old, new)
        and 0 <= workers <= MAX_WORKERS
    )


async def save(store: Store, frontend: str, slots: dict[str, dict[int, list[int]]]) -> None:
    """Keep this front end's worker slots; it runs with them: its starts are no longer counted."""
    await store.write(LOCAL + frontend, msgspec.msgpack.encode(LocalSlots(slots)), ttl_s=LOCAL_TTL_S)


async def load(store: Store, frontend: str) -> tuple[dict[str, SavedModel], int]:
    """What the served document and this front end's slots say it served, and the starts counted; ({}, 0)
    when this front end kept no slots (its first start), or a document is not what a front end writes."""
    try:
        _, served = await SERVED.read(store)
        kept, local = await local_doc(frontend).read(store)
    except msgspec.DecodeError as exc:
        log.error("the served state is not what a front end writes (%s): serving the config's versions", exc)
        return {}, 0
    if not kept:  # this front end never ran here: its config's workers (the served versions it follows)
        return {}, 0
    saved = {
        name: SavedModel(m.versions, m.default, local.slots.get(name, {}), m.updating)
        for name, m in served.models.items()
    }
    return saved, local.starts


async def take(store: Store, frontend: str) -> dict[str, SavedModel]:
    """`load` for a front end about to start with it, counting the starts until one runs (`save`): after
    MAX_STARTS in a row died first, the next serves the config's versions (a state that fails the start
    does not keep the front end from starting). {} when the store does not answer (the config's)."""
    try:
        saved, starts = await load(store, frontend)
        if not saved:
            return {}
        if starts >= MAX_STARTS:
            log.error(
                "%d front ends %s in a row died before they ran with the versions served (their logs say "
                "why, unless they were killed): serving the config's versions",
                starts,
                frontend,
            )
            return {}
        _, local = await local_doc(frontend).read(store)
        await store.write(
            LOCAL + frontend, msgspec.msgpack.encode(LocalSlots(local.slots, starts + 1)), ttl_s=LOCAL_TTL_S
        )
    except StoreError as exc:
        log.error("the cluster store does not answer (%s): serving the config's versions", exc)
        return {}
    return saved


class Restored(msgspec.Struct, frozen=True):
    models: list[ModelConfig]
    defaults: dict[str, int] = {}
    """Each restored model's default version."""
    slots: dict[tuple[str, int], list[int]] = {}
    """(model, version) -> its worker slots' indexes, for every version of a restored model."""

    def set_defaults(self, registry: ModelRegistry) -> None:
        for name, version in self.defaults.items():
            registry.set_default(name, version)

    def add_slots(self, launcher: SlotLauncher, local: list[tuple[ModelConfig, int]]) -> None:
        """The worker slots: the saved ones of a restored version, else the config's count."""
        for m, n in local:
            at = self.slots.get((m.name, m.version))
            if at is None:
                launcher.add(m.name, n, m.version)
            else:
                launcher.add_at(m.name, m.version, at)


def restore(
    models: list[ModelConfig], saved: dict[str, SavedModel], load_version: VersionLoader | None
) -> Restored:
    """The config's `models`, each saved one served as saved instead (a running update settled). One
    whose saved versions cannot all be loaded (no repository, a version removed from it) keeps the
    config's, and so does one the file does not name (added to the config since)."""
    by_name: dict[str, list[ModelConfig]] = {}
    for m in models:
        by_name.setdefault(m.name, []).append(m)
    out: list[ModelConfig] = []
    defaults: dict[str, int] = {}
    slots: dict[tuple[str, int], list[int]] = {}
    for name, configs in by_name.items():
        s = saved.get(name)
        problem = s.problem() if s is not None else None
        if problem is not None:
            log.error("model %s: the saved state has %s: serving the config's versions", name, problem)
        s = s.settled() if s is not None and problem is None else None
        loaded = _load(name, s, configs, load_version) if s is not None else None
        if s is None or loaded is None:
            out += configs
            continue
        out += loaded
        defaults[name] = s.default
        slots |= {(name, v): s.slots.get(v, []) for v in s.versions}
        log.info(
            "model %s: serving version(s) %s (default %d) with worker slots %s, as the previous owner "
            "front end did (the config names %s)",
            name,
            s.versions,
            s.default,
            {v: s.slots.get(v, []) for v in s.versions},
            [c.version for c in configs],
        )
    return Restored(out, defaults, slots)


def _load(
    name: str, s: SavedModel, configs: list[ModelConfig], load_version: VersionLoader | None
) -> list[ModelConfig] | None:
    configured = {c.version: c for c in configs}
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
