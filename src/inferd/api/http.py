"""HTTP helpers shared by the route modules: content type, bounded body reads, waiting for results
with deadline and disconnect handling."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from inferd.api.asgi import HttpRequest, HttpResponse
from inferd.batching.dispatcher import ModelRuntime
from inferd.batching.queue import QueuedItem
from inferd.clock import Clock
from inferd.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType


class ClientGone(Exception):
    """The caller disconnected while its request was queued or running."""


JSON_TYPES = ("application/json", "application/octet-stream", "")


def check_content_type(request: HttpRequest, allowed: Sequence[str] = JSON_TYPES) -> None:
    ctype = (request.header(b"content-type") or "").split(";", 1)[0].strip().lower()
    if ctype not in allowed:
        raise UnsupportedMediaType(
            f"unsupported Content-Type {ctype!r}: send application/json (or application/octet-stream with "
            "Inference-Header-Content-Length for binary tensors)"
        )


async def read_body(request: HttpRequest, limit: int) -> bytes:
    """The whole body, or PayloadTooLarge as soon as it is known to exceed `limit` (without reading it all)."""
    declared = request.header(b"content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest(f"Content-Length {declared!r} is not a number") from None
        if size > limit:
            raise PayloadTooLarge(f"request body of {size} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    total = 0
    try:
        async for chunk in request.chunks():
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ConnectionAbortedError:
        raise ClientGone() from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def wait_for_items(
    runtime: ModelRuntime, items: list[QueuedItem], deadline: float | None, clock: Clock, request: HttpRequest
) -> list[Any]:
    """Wait for every item's result. At the deadline the items are expired (504); if the client
    disconnects they are withdrawn. One timer handle and one receive task per request, no wait() sets."""
    loop = asyncio.get_running_loop()
    futures = [i.reply for i in items]
    waiter: asyncio.Future[Any] = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
    timer = None
    if deadline is not None:
        timer = loop.call_at(loop.time() + (deadline - clock.now()), runtime.expire, items)
    gone = loop.create_task(request.receive())
    gone.add_done_callback(lambda t: t.cancelled() or runtime.withdraw(items))
    try:
        result = await waiter
    except asyncio.CancelledError:
        if gone.done() and not gone.cancelled():
            raise ClientGone() from None
        runtime.withdraw(items)
        raise
    finally:
        if timer is not None:
            timer.cancel()
        gone.cancel()
    return [result] if len(futures) == 1 else result


def json_response(
    body: bytes, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None
) -> HttpResponse:
    return HttpResponse(body, status, b"application/json", headers or [])
