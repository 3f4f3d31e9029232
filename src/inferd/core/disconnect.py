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
    fut = work if isinstance(work, asyncio.Future) else asyncio.ensure_future(work)
    watch = _Watch(receive, fut)
    timer = None
    if watch_after_s > 0:
        timer = asyncio.get_running_loop().call_later(watch_after_s, watch.start)
    else:
        watch.start()
    try:
        return await fut
    except asyncio.CancelledError:
        caller = asyncio.current_task()  # looked up only here: the common path stays cheap
        caller_cancelled = caller is not None and caller.cancelling() > 0
        if watch.gone and not caller_cancelled:
            raise ClientGone() from None
        raise
    finally:
        if timer is not None:
            timer.cancel()
        if watch.task is not None and not watch.task.done():
            watch.task.cancel()  # its receive() ends on the loop's next turn; nothing waits for it


class _Watch:
    """Reads receive() (a task per message: uvicorn's receive() is a coroutine) until the client
    disconnects, then cancels the work. A receive() that fails counts as a disconnect: the connection
    cannot carry an answer either way."""

    __slots__ = ("gone", "receive", "task", "work")

    def __init__(self, receive: Receive, work: asyncio.Future[Any]) -> None:
        self.receive = receive
        self.work = work
        self.task: asyncio.Task[dict[str, Any]] | None = None
        self.gone = False

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.receive())  # type: ignore[arg-type]
        self.task.add_done_callback(self._received)

    def _received(self, task: asyncio.Task[dict[str, Any]]) -> None:
        if task.cancelled():  # the work ended first
            return
        exc = task.exception()
        if exc is None and task.result().get("type") != "http.disconnect":
            if not self.work.done():
                self.start()  # another message (a body chunk): keep watching
            return
        if exc is not None:
            log.debug("receive() failed while watching for a disconnect: %r", exc)
        self.gone = True
        self.work.cancel()  # no effect if the work has ended already: its result stands
