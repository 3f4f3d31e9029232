"""Creating and deleting search indexes while the server runs (PUT and DELETE /v1/indexes/{name}).

PUT is create-or-verify: a new name is created (its settings saved in data_dir first, so it is served
again after a restart; then its runtime and its shards x replicas workers start); an existing index with
the same settings answers as it is; one with other settings is a Conflict naming them. DELETE retires
the workers, stops the runtime and removes the index's data. An index declared in the model repository
is deleted there, not through the API.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from inferd.cluster.served import changes
from inferd.config import ModelConfig
from inferd.errors import BadRequest, Conflict, NotFound, ServingError
from inferd.kinds.search.config import SearchParams, index_config, params_of
from inferd.kinds.search.store import SETTINGS_FILE, IndexStore
from inferd.runtime.contract import Runtime
from inferd.runtime.membership import WorkerDirectory
from inferd.runtime.registry import ModelRegistry

log = logging.getLogger("inferd.search")

WORKERS_PER_CPU = 8
"""An API-created index runs at most this many shard replica processes per CPU of the machine..."""
MIN_WORKER_CAP = 16
"""... and at least this many may always be asked for (a small machine still takes a 4 x 2 index)."""
MAX_WORKER_CAP = 256
READY_WAIT_S = 30.0
"""How long PUT waits for a new index's replicas (each shard's first) before it answers."""


class Server(Protocol):
    """What index administration needs of the composition root (server.py)."""

    registry: ModelRegistry
    directory: WorkerDirectory
    """Every served version's workers: a new index's replicas join it."""
    supervisor: Any
    index_sync: Any
    """Several front ends: every front end serves the owner's indexes (kinds/search/shared_indexes.py);
    else None."""

    def add_version(self, config: ModelConfig) -> Runtime: ...

    def remove_version(self, name: str, version: int, why: ServingError | None = None) -> None: ...


def worker_cap(cpus: int | None) -> int:
    """How many shard x replica processes one PUT may start on a machine with `cpus` CPUs."""
    return min(MAX_WORKER_CAP, max(MIN_WORKER_CAP, WORKERS_PER_CPU * (cpus or 1)))


class IndexAdmin:
    def __init__(self, server: Server, store: IndexStore, max_workers: int) -> None:
        self.server = server
        self.store = store
        self.max_workers = max_workers
        """The most shard replica processes one index created through the API may run."""
        self._lock = asyncio.Lock()

    def find(self, name: str) -> Any:
        """The search runtime serving index `name`; NotFound naming the indexes there are."""
        registry = self.server.registry
        if name not in registry or registry.get(name).kind != "search":
            raise NotFound(f"no index {name!r}; indexes: {registry.names(frozenset({'search'}))}")
        return registry.get(name)

    async def create(self, name: str, params: SearchParams) -> bool:
        """True when created, False when it exists with these settings; Conflict otherwise. BadRequest,
        before anything starts, when the index would run more than `max_workers` processes."""
        workers = params.shards * params.replicas
        if workers > self.max_workers:
            raise BadRequest(
                f"index {name!r} asks for {params.shards} shards x {params.replicas} replicas = {workers} "
                f"worker processes; this server starts at most {self.max_workers} for one index "
                f"({WORKERS_PER_CPU} per CPU, at least {MIN_WORKER_CAP}): use fewer shards or replicas"
            )
        async with self._lock:
            await self._catch_up()
            registry = self.server.registry
            if name in registry:
                rt = registry.get(name)
                if rt.kind != "search":
                    raise Conflict(f"{name!r} is a {rt.kind} model, not an index: pick another name")
                have = params_of(rt.config)
                if have != params:
                    diff = {
                        k: {"have": v, "asked": getattr(params, k)}
                        for k, v in have.model_dump().items()
                        if v != getattr(params, k)
                    }
                    raise Conflict(f"index {name!r} exists with other settings: {diff}")
                return False
            config = index_config(name, params)
            self.store.save(name, params)  # first: a crash from here on serves it again at start
            rt = self.server.add_version(config)
            if self.server.index_sync is not None:  # a worker joins every front end: each must know it
                try:
                    with changes():  # the server's document did not take it: 503, and nothing is left
                        await self.server.index_sync.until_followers_serve(name)
                except ServingError:
                    self.server.remove_version(name, rt.version, NotFound(f"index {name!r} was not created"))
                    self.store.remove(name)
                    raise
            self.server.supervisor.add(name, config.workers, None)
            log.info("index %s created: %s", name, params.model_dump())
        await self._until_ready(rt)
        return True

    async def _catch_up(self) -> None:
        """Several front ends: serve the server's indexes as the shared store has them before one is
        created or deleted here (kinds/search/shared_indexes.py); ClusterUnavailable (503) when the store
        does not answer."""
        if self.server.index_sync is not None:
            with changes():
                await self.server.index_sync.catch_up()

    async def _until_ready(self, rt: Runtime) -> None:
        """Until every shard has a serving replica (bounded: the answer then says ready: false)."""
        try:
            async with asyncio.timeout(READY_WAIT_S):
                while not rt.ready:
                    await self.server.directory.changed(rt.name, rt.version)
        except NotFound:  # deleted meanwhile: nothing left to wait for
            return
        except TimeoutError:
            log.warning("index %s is not ready %.0f s after its creation", rt.name, READY_WAIT_S)

    async def delete(self, name: str) -> None:
        async with self._lock:
            await self._catch_up()
            rt = self.find(name)
            if not (self.store.folder(name) / SETTINGS_FILE).is_file():
                raise Conflict(
                    f"index {name!r} is declared in the model repository: remove its folder there instead"
                )
            supervisor = self.server.supervisor
            for slot in supervisor.live_slots(name):
                supervisor.retire(slot)
                supervisor.kill(slot.incarnation)
            # what still reaches it (a write racing the deletion) is told it is gone: 404, never a 500
            self.server.remove_version(name, rt.version, NotFound(f"index {name!r} was deleted"))
            self.store.remove(name)
            if self.server.index_sync is not None:  # a name created again must not find the old index
                with changes():  # gone here; the server's document says so once the store answers
                    await self.server.index_sync.until_followers_drop(name)
            log.info("index %s deleted", name)
