"""Watching for a client that disconnects while its request's work runs: one helper for every route.

`until_disconnect(receive, work)` awaits `work` while a watcher task reads receive() until
`http.disconnect`. If the client leaves first, `work` is cancelled and ClientGone raised (a 499); if
`work` ends first, the watcher is cancelled (it ends on the loop's next turn) and the result returned. The infer path
starts the watch late (`watch_after_s`), so a request that ends sooner never creates the watcher task:
at thousands of requests per second, creating and cancelling it is a large share of the per-request CPU.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger("inferd.api")

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]


class ClientGone(Exception):
    """The caller disconnected while its request was queued or running."""


async def until_disconnect(receive: Receive, work: Awaitable[T], watch_after_s: float = 0.0) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled and ClientGone is raised.

    A future (the infer path's replies) is awaited in the calling task, with no task of its own; a
    coroutine runs in a task this call owns and awaits. The watch starts after `watch_after_s` seconds
    (0: at once). If the caller itself is cancelled, `work` is cancelled too and CancelledError
    propagates, even when the client has left as well."""
    fut = asyncio.ensure_future(work)
    watch = _Watch(receive, fut)
    timer = None
    if watch_after_s > 0:
        timer = asyncio.get_running_loop().call_later(watch_after_s, watch.start)
    else:
        watch.start()
    caller = asyncio.current_task()
    cancelling = caller.cancelling() if caller is not None else 0
    try:
        return await fut
    except asyncio.CancelledError:
        caller_cancelled = caller is not None and caller.cancelling() > cancelling
        if watch.gone and not caller_cancelled:
            raise ClientGone() from None
        raise
    finally:
        if timer is not None:
            timer.cancel()
        if watch.task is not None:
            _stop(watch.task)


class _Watch:
    """The watcher task: reads receive() until the client disconnects, then cancels the work."""

    __slots__ = ("gone", "receive", "task", "work")

    def __init__(self, receive: Receive, work: asyncio.Future[Any]) -> None:
        self.receive = receive
        self.work = work
        self.task: asyncio.Task[None] | None = None
        self.gone = False

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._watch(), name="disconnect-watch")

    async def _watch(self) -> None:
        try:
            while (await self.receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:  # the connection cannot answer either way: the client is as good as gone
            log.debug("receive() failed while watching for a disconnect: %r", exc)
        self.gone = True
        self.work.cancel()  # no effect if the work has ended already: its result stands


def _stop(task: asyncio.Task[None]) -> None:
    """Cancel the watcher. Its receive() ends at the cancellation, on the loop's next turn: awaiting
    that here (a waiter and a timer per request) cost ~10% of the infer path's CPU at 3,000 req/s, so
    the task is left to finish on its own and its end is checked by a callback."""
    if task.done():  # it saw the disconnect
        return
    task.cancel()
    task.add_done_callback(_ended)


def _ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("the disconnect watcher failed: %r", task.exception())
