"""Watching for a caller that goes away while its request's work runs: one helper for every edge.

`until_disconnect(departure, work)` awaits `work` while `departure` (the edge's hook on the caller, the
Call's `departure`) watches for the caller leaving. If it leaves first, `work` is cancelled and
ClientGone raised (an HTTP 499); if `work` ends first, the watch is dropped and the result returned.

Nothing here knows a wire: the HTTP edge's connection (api/frontdoor.py, api/peer.py) is one
`Departure`; a gRPC edge's context would be another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from inferd.errors import ClientGone

__all__ = ["STAYING", "ClientGone", "Departure", "Staying", "Unwatch", "until_disconnect"]

T = TypeVar("T")
Unwatch = Callable[[], None]


class Departure(Protocol):
    """The edge's hook on the caller of one request: tells when it has gone away."""

    def watch(self, on_gone: Callable[[], None]) -> Unwatch:
        """Call `on_gone` once if the caller leaves (soon, if it has already); the result stops it."""
        ...


class Staying:
    """A caller that never leaves (a call made in-process, with no connection to lose)."""

    __slots__ = ()

    def watch(self, on_gone: Callable[[], None]) -> Unwatch:
        return _nothing


def _nothing() -> None:
    return None


STAYING = Staying()


async def until_disconnect(departure: Departure, work: Awaitable[T]) -> T:
    """`work`'s result; if the caller leaves first, `work` is cancelled and ClientGone is raised.

    A future (the infer path's replies) is awaited in the calling task, with no task of its own; a
    coroutine runs in a task this call owns and awaits. If the caller itself is cancelled, `work` is
    cancelled too and CancelledError propagates, even when the client has left as well."""
    fut = work if isinstance(work, asyncio.Future) else asyncio.ensure_future(work)
    gone = False

    def on_gone() -> None:
        nonlocal gone
        gone = True
        fut.cancel()  # no effect if the work has ended already: its result stands

    unwatch = departure.watch(on_gone)
    try:
        return await fut
    except asyncio.CancelledError:
        caller = asyncio.current_task()  # looked up only here: the common path stays cheap
        caller_cancelled = caller is not None and caller.cancelling() > 0
        if gone and not caller_cancelled:
            raise ClientGone() from None
        raise
    finally:
        unwatch()
