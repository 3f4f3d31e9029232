"""The repository index (Triton's `POST /v2/repository/index`): every model the server may serve, a row
per served version with its state, and for a model not served why (the reasons below, a failed load's
cause, a folder's parse error). Made from model control's state (fleet/model_control.py) as a value."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum

from inferd.errors import NotFound
from inferd.runtime.registry import ModelRegistry

UNLOADED = "unloaded"
"""An operator's unload (the repository API)."""
NOT_LOADED = "not loaded"
"""Not served at start ("explicit"), or new to the repository."""
REMOVED = "removed from the repository"
"""Poll: its folder left the repository (served again once it is back)."""


def unloaded_error(name: str, why: str) -> NotFound:
    """How a request of a model of the repository that is not served is refused: 404 saying so (and
    why, unless an operator unloaded it: "is unloaded" says it all), and how to load it."""
    said = "" if why == UNLOADED else f" ({why})"
    return NotFound(f"model {name!r} is unloaded{said}: load it with POST /v2/repository/models/{name}/load")


class ModelState(StrEnum):
    READY = "READY"
    LOADING = "LOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True, slots=True)
class IndexRow:
    """One row of the repository index (Triton's JSON: name, version, state, reason)."""

    name: str
    version: str
    state: ModelState
    reason: str = ""


def index_rows(
    names: list[str],
    registry: ModelRegistry,
    unloaded: Mapping[str, str],
    broken: Mapping[str, str],
    loading: Collection[str],
    visible: Callable[[str], bool],
    unready: Callable[[str, int], str | None] = lambda name, version: None,
) -> list[IndexRow]:
    """The rows of `names` the caller may see (`visible`): a model `loading` and not served yet is
    LOADING; one `unloaded`, or not served, UNAVAILABLE with why; a served one a row per version, READY
    when a worker is (a `broken` folder's error as the reason: what served serves on; else `unready`'s,
    a pooled model's load backoff or empty pool: fleet/pools.py)."""
    rows: list[IndexRow] = []
    for name in names:
        if not visible(name):
            continue
        if name in loading and name in unloaded:
            rows.append(IndexRow(name, "", ModelState.LOADING, "loading"))
        elif name in unloaded or name not in registry:
            rows.append(IndexRow(name, "", ModelState.UNAVAILABLE, unloaded.get(name) or broken.get(name, NOT_LOADED)))
        else:
            reason = broken.get(name, "")
            for version in registry.versions(name):
                ready = registry.get(name, version).ready
                state = ModelState.READY if ready else ModelState.UNAVAILABLE
                why = reason or ("" if ready else unready(name, version) or "no worker ready")
                rows.append(IndexRow(name, str(version), state, why))
    return rows
