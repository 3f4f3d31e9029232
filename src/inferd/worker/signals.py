"""A worker process's stop signals: the first SIGTERM (or SIGINT) drains the worker, a second stops it at once.

Draining (Worker.drain): the worker takes no new work and tells each front end it serves (Drain); each
answers Drain after the last work it sent; then the device finishes what it holds, delivers it, and the
process exits 0. The handler is installed on the running loop, so it works for PID 1 in a container too
(the kernel drops only signals without a handler there).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("inferd.worker")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

DRAIN_ANSWER_TIMEOUT_S = 5.0
"""How long a draining worker waits for its front ends to answer Drain (a front end of an older inferd
never does) before the device finishes what it holds without them."""


async def run_until_done(work: Coroutine[Any, Any, int], drain: Callable[[], bool]) -> int:
    """Run the worker (`work`, its exit code) with the stop signals handled: the first calls `drain`
    (False: it cannot drain, stop now); a second, or one `drain` refused, cancels the work: exit 128 +
    the signal's number (0 when stopping at once was the answer to the first)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)  # awaited below: its owner is this coroutine
    signalled: list[int] = []

    def on_signal(sig: signal.Signals) -> None:
        signalled.append(sig)
        if len(signalled) == 1:
            log.info("%s received: the worker drains (a second signal stops it at once)", sig.name)
            if drain():
                return
        log.warning("%s received: stopping the worker at once", sig.name)
        task.cancel()

    handled = STOP_SIGNALS if threading.current_thread() is threading.main_thread() else ()
    for sig in handled:  # (a worker in a Ray actor runs in a thread: Ray stops it)
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not signalled or (current is not None and current.cancelling()):
            raise  # cancelled from outside, not by a signal
        return 0 if len(signalled) == 1 else 128 + signalled[-1]
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
