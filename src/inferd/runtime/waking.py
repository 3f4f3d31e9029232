"""Serving a model on demand: what a runtime with no worker in service asks of whoever can give it one.

A model that can be served on demand (a pooled batch model: its pool loads it; a batch or LLM model whose
`[autoscale] min_workers = 0`: the scaling loop starts a worker) holds its first requests instead of
refusing them with a 503, bounded by the cold rule (runtime/cold.py): a batch model in its cold queue
(kinds/batch/cold.py), an LLM model before placing their sequences (kinds/llm/cold.py); and it wakes its
`Waker`.
The waker decides nothing here: it is told the demand and says how long serving takes.
Such a model's readiness is its own: it never holds the server's down (runtime/readiness.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from inferd.errors import WorkerUnavailable


class Waker(Protocol):
    def wakeable(self, model: str, version: int) -> str | WorkerUnavailable | None:
        """None when the model version can be served on demand now; else why not: the 503's message
        (e.g. "pool 'p' has no worker"), or the 503 itself, made for this call, when it says when to
        retry (e.g. a failed load's backoff: `WorkerUnavailable(message, retry_after_s=left)`)."""
        ...

    def wake(self, model: str, version: int, waiting: int, oldest_age_s: float) -> None:
        """Requests wait for a worker: `waiting` of them, the oldest for `oldest_age_s`. Called on each
        admission while no worker is in service, and again while they wait; cheap and idempotent (one
        load or one scale-up per need, however often it is called)."""
        ...

    def eta_s(self, model: str, version: int) -> float | None:
        """The measured time from a wake to a worker in service (a load, a worker's start); None while
        none was measured. A request whose deadline is nearer gets a 429 at once, with it as Retry-After."""
        ...


SCALE_FROM_ZERO = "scale_from_zero"
"""The cause of a cold start the scaling loop ends (a model whose `[autoscale] min_workers = 0`)."""
POOL_LOAD = "pool_load"
"""The cause of a cold start its pool ends (a pooled model loaded on a pool worker)."""


@dataclass(frozen=True, slots=True)
class Wake:
    """A model's waker and the cause its cold starts are counted under (`inferd_cold_start_seconds`'s
    `cause` label: SCALE_FROM_ZERO, POOL_LOAD)."""

    waker: Waker
    cause: str


class Wakers:
    """Who wakes each model served on demand, by model name (every version of it asks the same waker,
    naming its version). The composition root holds one and hands it to every runtime it builds
    (`RuntimeContext.wakers`); whoever wakes a model registers itself (`set`) once it is built: the
    scaling loop of a `min_workers = 0` model, a pool's manager for its pooled models. A runtime looks its
    waker up only while it has no worker in service, so a waker registered after the runtime was built
    (or replaced, or cleared) is the one asked."""

    def __init__(self) -> None:
        self._wakes: dict[str, Wake] = {}

    def set(self, model: str, waker: Waker, cause: str) -> None:
        self._wakes[model] = Wake(waker, cause)

    def clear(self, model: str) -> None:
        self._wakes.pop(model, None)

    def of(self, model: str) -> Wake | None:
        return self._wakes.get(model)

    def on_demand(self, model: str) -> bool:
        """Whether the model is served on demand (a waker is registered for it): its readiness is its own,
        and never holds the server's down (runtime/readiness.py)."""
        return model in self._wakes
