"""When one of several front ends starts listening."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from inferd.config import ServerConfig

REMOTE_REJOIN_WAIT_S = 5.0
"""A front end among several with no local workers waits this long at most before it listens: remote
workers rejoin a restarted front end within their reconnect backoff (2 s at most); at a first start
there may be none yet, and the port must open for probes (`/v2/health/live`, readiness 503)."""


def ready_wait_s(local_workers: int, config: ServerConfig) -> float:
    """How long a front end among several waits for workers before it listens: for local workers, as
    long as they may take to start; for remote ones only (which may never come), a rejoin's time."""
    if local_workers:
        return config.worker_start_timeout_s
    return min(REMOTE_REJOIN_WAIT_S, config.worker_start_timeout_s)


async def await_ready(ready: Callable[[], bool], timeout_s: float, poll_s: float = 0.02) -> None:
    """Return once `ready()` (every model has a ready worker or can be served on demand now:
    runtime/readiness.py `models_ready`) or after `timeout_s`.

    A front end among several listens only then (uvicorn awaits the lifespan's startup before it
    listens): the kernel sends a listener on the shared port its share of new connections at once, and
    a front end with no worker yet (a restarted one: workers rejoin it within a backoff step) would
    refuse them all with 503."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while not ready():  # noqa: ASYNC110 - readiness is computed from several runtimes: polled
                await asyncio.sleep(poll_s)
