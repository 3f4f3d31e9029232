"""The wire messages of model pools (wire protocol 6), part of wire/protocol.py's `Message`.

A pool worker joins each front end with a pool link (`Hello.pool` set, `Hello.model` empty): the
front end asks it to load and unload models (LoadModel, UnloadModel); the worker tells every front end
what it holds (PoolState) and how each load ended (LoadResult). A model it holds is served over a link
of its own, as any worker of that model is (worker/pool.py, pools/manager.py).
"""

from __future__ import annotations

import msgspec


class LoadModel(msgspec.Struct, tag="pool_load"):
    """Front end -> pool worker: load this model version (its config, as a Welcome carries it). A load
    of a model loading or loaded already joins it. `wait_s`: how long the load may wait for room (every
    loaded model protected by min_resident_s) before it is given up."""

    model: str
    version: int
    config_json: bytes
    wait_s: float = 0.0


class UnloadModel(msgspec.Struct, tag="pool_unload"):
    """Front end -> pool worker: drain this model version (it finishes what it holds), then unload it."""

    model: str
    version: int


class LoadResult(msgspec.Struct, tag="pool_loaded"):
    """Pool worker -> every front end: a load ended. `error` names the cause when it failed (its
    sizes, when the model does not fit the budget)."""

    model: str
    version: int
    ok: bool
    load_s: float = 0.0
    memory_mb: float = 0.0
    """What the load cost, measured (device memory where there is a device, else resident memory)."""
    error: str = ""


class HeldModel(msgspec.Struct):
    model: str
    version: int
    state: str
    """"loading", "ready" or "unloading"."""
    memory_mb: float
    """Measured once loaded; the model's estimate (memory_mb) while it loads."""
    idle_s: float = 0.0
    """Since its last batch ended (or its load, when it ran none)."""
    evictable: bool = False
    """Idle, and past min_resident_s: the next load that needs room may evict it."""


class QueuedLoad(msgspec.Struct):
    """A load waiting on a pool worker to start (for room, or for a load slot: max_concurrent_loads)."""

    model: str
    version: int
    memory_mb: float
    """What it is planned at (measured here before, else the model's estimate): the room it will take."""


class PoolState(msgspec.Struct, tag="pool_state"):
    """Pool worker -> every front end: what it holds, on every change and with each heartbeat."""

    budget_mb: float
    used_mb: float
    models: list[HeldModel] = []
    loads: dict[str, int] = {}
    """Model -> loads that ended ready on this worker since it started (cumulative)."""
    evictions: dict[str, int] = {}
    """Model -> evictions on this worker since it started (cumulative)."""
    waiting_loads: int = 0
    """Loads waiting for room or for a load slot (max_concurrent_loads)."""
    queued: list[QueuedLoad] = []
    """Those loads, in the order they start: a front end that did not ask for one sees the model coming
    here (it joins that load, rather than asking another worker for another copy) and the room it will
    take. Added after protocol 6 shipped, at the end with a default: a PoolState of a worker without it
    decodes with none listed (only `waiting_loads` counts them), and an older front end ignores it."""
