"""BatchService: the one way a request's items reach a batch model and come back. Every caller of a
batch model goes through it (OIP infer and /v1/embeddings in api/, shadow copies in gateway/shadow.py,
search's embedder in kinds/search/embedder.py); nothing outside kinds/batch enqueues or withdraws items
itself (tests/unit/test_batch_service.py reads src/inferd for it).

    enqueue   ModelRuntime.enqueue: admission (worker, loop lag, room, tenant share, predicted wait
              against the deadline: Overloaded / WorkerUnavailable before anything is queued)
    wait      every item's reply, in the calling task (no task, no wait_for of its own)
    expire    at the deadline, ModelRuntime.expire answers every unanswered item DeadlineExceeded
              (504): a queued one leaves the queue and never reaches a worker
    withdraw  when the wait is cancelled, the caller goes away (ClientGone, 499) or an item fails: what
              is still queued never runs, what runs is answered to nobody

The deadline is absolute, on the runtime's clock (as `asyncio.timeout_at` takes it on the loop's); the
queue drops items past it when a batch is cut (Dispatcher._expire_cut), so the deadline of a batch
request is kept in those three places and nowhere else.

"The caller went away" is protocol-neutral: `gone` registers a callback to run once the caller has
gone and returns what stops watching (an HTTP request's `Peer.watch`; None: nobody to watch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from inferd.clock import Clock
from inferd.errors import ClientGone
from inferd.kinds.batch.delivery import ItemResult
from inferd.kinds.batch.queue import QueuedItem
from inferd.routing.fairness import INTERACTIVE, NO_TENANT, TenantShare

Unwatch = Callable[[], None]
GoneWatch = Callable[[Callable[[], None]], Unwatch]
"""Registers `on_gone`, called once if the caller goes away (soon, if it has already); returns what stops
the watch."""


class BatchQueue(Protocol):
    """What the service needs of a batch model's runtime (kinds/batch/dispatcher.py ModelRuntime)."""

    clock: Clock

    def enqueue(
        self, payloads: Sequence[Any], deadline: float | None, priority: int, tenant: TenantShare
    ) -> list[QueuedItem]: ...

    def withdraw(self, items: Sequence[QueuedItem]) -> None: ...

    def expire(self, items: Sequence[QueuedItem]) -> None: ...


class BatchService:
    """One batch model's requests: enqueue, wait under the deadline, expire or withdraw."""

    __slots__ = ("_rt",)

    def __init__(self, runtime: BatchQueue) -> None:
        self._rt = runtime

    async def infer(
        self,
        payloads: Sequence[Any],
        *,
        deadline: float | None,
        priority: int = INTERACTIVE,
        share: TenantShare = NO_TENANT,
        gone: GoneWatch | None = None,
        refuse_late: bool = True,
    ) -> list[ItemResult]:
        """Every payload's result, in order. Raises what admission raises (nothing queued then), the
        first item's ServingError (DeadlineExceeded once `deadline` passes), ClientGone when `gone`
        reports the caller left, or CancelledError when this wait is cancelled. `refuse_late=False`
        admits without comparing the predicted wait with the deadline (the deadline still expires the
        items): for callers whose batches the estimate does not describe (search's embedder)."""
        rt = self._rt
        items = rt.enqueue(payloads, deadline if refuse_late else None, priority, share)
        replies = [item.reply for item in items]
        waiter: asyncio.Future[Any] = replies[0] if len(replies) == 1 else asyncio.gather(*replies)
        expiry: asyncio.TimerHandle | None = None
        unwatch: Unwatch | None = None
        try:
            if deadline is not None:
                loop = asyncio.get_running_loop()
                expiry = loop.call_at(loop.time() + (deadline - rt.clock.now()), rt.expire, items)
            if gone is not None:
                # the caller left: the wait ends (no effect once every item is answered: results stand)
                unwatch = gone(waiter.cancel)
            result = await waiter
        except asyncio.CancelledError:
            rt.withdraw(items)
            # only this wait and the caller's leaving cancel the replies: if this task was not
            # cancelled, the caller left
            if gone is not None and not _caller_cancelled():
                raise ClientGone() from None
            raise
        except BaseException:  # an item failed (or expired): the others are answered to nobody
            rt.withdraw(items)
            raise
        finally:
            if expiry is not None:
                expiry.cancel()
            if unwatch is not None:
                unwatch()
        return [result] if len(replies) == 1 else result


def _caller_cancelled() -> bool:
    """Whether the task waiting was itself cancelled (looked up only then: the common path stays cheap)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
