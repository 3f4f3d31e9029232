"""The worker sides of the kinds whose workers serve something other than a model: a search index's
shard replica (kinds/search/replica.py). The worker process (worker/main.py) looks the Welcome's kind up
in `WORKER_SIDES` and, when it is there, hands every front end's connection to that side instead of
loading a model; a kind with a worker side of its own adds its entry here, and worker/ needs no change.
Each entry imports its side when first built, so a model's worker never loads an index's libraries (faiss)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol


class WorkerSide(Protocol):
    """What a worker serves for every front end it joins, in place of a model."""

    async def serve(
        self,
        link: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        version: int,
        heartbeat_s: float,
    ) -> str:
        """One front end's link (its place in --connect), until that front end goes ("lost") or drains
        the worker ("drained")."""
        ...


WorkerSideFactory = Callable[[str], WorkerSide]
"""Builds a worker's side from its worker id (once per worker: every front end's link shares it)."""


def _search_replica(worker_id: str) -> WorkerSide:
    from inferd.kinds.search.replica import Replica  # faiss: only in a search index's workers

    return Replica(worker_id)


WORKER_SIDES: Mapping[str, WorkerSideFactory] = MappingProxyType({"search": _search_replica})
"""By the kind a Welcome's model config names."""
