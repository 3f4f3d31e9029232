"""Serving a model on demand: what a runtime with no worker in service asks of whoever can give it one.

A batch model that can be served on demand (a pooled model: its pool loads it; a model whose
`[autoscale] min_workers = 0`: the scaling loop starts a worker) holds its first requests instead of
refusing them with a 503: it admits them into a bounded cold queue (kinds/batch) and wakes its `Waker`.
The waker decides nothing here: it is told the demand and says how long serving takes.
"""

from __future__ import annotations

from typing import Protocol


class Waker(Protocol):
    def wakeable(self, model: str, version: int) -> str | None:
        """None when the model version can be served on demand now; else why not (the 503's message,
        e.g. "pool 'p' has no worker")."""
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
