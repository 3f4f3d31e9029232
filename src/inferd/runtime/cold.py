"""The cold rule: whether a model version with no worker in service holds a request while its waker
(runtime/waking.py) gives it one, or refuses it at once. Every kind served on demand applies it the same
way (kinds/batch/cold.py holds items in the batch queue; kinds/llm/cold.py holds sequences before they
are placed); what differs is what a kind holds and how it waits. For a request of `n` held units:

    no waker registered                    -> 503 "has no ready worker", as for every model without one
    the waker cannot wake it (a reason)    -> 503 with that reason (or the 503 it gave: its Retry-After)
    the cold hold would pass its bound     -> 429, Retry-After = the waker's measured eta (1 s unmeasured)
    the eta is past the request's deadline -> 429, Retry-After = the eta
    else                                   -> held; the waker is told at once, and again every REWAKE_S
                                              while requests are held and no worker serves

A stampede on a cold model is refused at once, not held for a worker that would serve it late.
"""

from __future__ import annotations

from inferd.errors import Overloaded, WorkerUnavailable, retry_after_s
from inferd.runtime.waking import Wake

REWAKE_S = 0.25
"""While requests are held with no worker in service, the waker is told again this often."""

UNMEASURED_RETRY_S = 1.0
"""Retry-After of a cold refusal while the waker has measured no eta yet."""


def cold_bound(cold_queue_size: int | None, max_queue_size: int, max_batch_size: int) -> int:
    """Units a model with no worker in service holds at most: `cold_queue_size` within the most the
    model's queue takes (`max_queue_size`); unset, four full batches (`max_batch_size`) within it."""
    if cold_queue_size is not None:
        return min(cold_queue_size, max_queue_size)
    return min(max_queue_size, 4 * max_batch_size)


def waking(wake: Wake | None, model: str, version: int) -> Wake:
    """The model's waker when it can wake the version now; else the 503: no waker, or the waker's reason."""
    if wake is None:
        raise WorkerUnavailable(f"model '{model}' has no ready worker; retry shortly")
    reason = wake.waker.wakeable(model, version)
    if reason is not None:
        raise reason if isinstance(reason, WorkerUnavailable) else WorkerUnavailable(reason)
    return wake


def cold_refusal(
    model: str, queued: int, n: int, bound: int, now: float, deadline: float | None, eta_s: float | None
) -> Overloaded | None:
    """Why `n` more units cannot be held with `queued` held already (a 429), or None: they can."""
    retry = UNMEASURED_RETRY_S if eta_s is None else max(UNMEASURED_RETRY_S, eta_s)
    if queued + n > bound:
        return Overloaded(
            f"model '{model}' has no worker in service and its cold queue is full ({queued}/{bound} items "
            f"held while a worker starts, request needs {n}); retry in {retry_after_s(retry)} s",
            retry_after_s=retry,
            reason="queue_full",
        )
    if deadline is not None and eta_s is not None and now + eta_s > deadline:
        left_ms = max(0.0, (deadline - now) * 1000.0)
        return Overloaded(
            f"model '{model}' has no worker in service and one takes {eta_s * 1000:.0f} ms to start "
            f"(measured), past the remaining deadline of {left_ms:.0f} ms; retry in {retry_after_s(retry)} s",
            retry_after_s=retry,
            reason="deadline",
        )
    return None
