"""Small HTTP helpers shared by the route modules: bounded body reads, waiting with disconnect detection,
JSON responses."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from inferd.batching.dispatcher import ModelRuntime
from inferd.batching.queue import QueuedItem
from inferd.clock import Clock
from inferd.errors import BadRequest, DeadlineExceeded, PayloadTooLarge, UnsupportedMediaType


class ClientGone(Exception):
    """The caller disconnected while its request was queued or running."""


JSON_TYPES = ("application/json", "application/octet-stream", "")


def check_content_type(request: Request, allowed: Sequence[str] = JSON_TYPES) -> None:
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype not in allowed:
        raise UnsupportedMediaType(
            f"unsupported Content-Type {ctype!r}: send application/json (or application/octet-stream with "
            "Inference-Header-Content-Length for binary tensors)"
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or PayloadTooLarge as soon as it is known to exceed `limit` (without reading it all)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest(f"Content-Length {declared!r} is not a number") from None
        if size > limit:
            raise PayloadTooLarge(f"request body of {size} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def wait_for_items(
    runtime: ModelRuntime, items: list[QueuedItem], deadline: float | None, clock: Clock, request: Request
) -> list[Any]:
    """Wait for every item's result; withdraw them if the deadline passes or the client disconnects."""
    loop = asyncio.get_running_loop()
    futures = [i.reply for i in items]
    waiter: asyncio.Future[Any] = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
    disconnected = asyncio.ensure_future(request.receive())
    try:
        if deadline is None:
            done, _ = await asyncio.wait((waiter, disconnected), return_when=asyncio.FIRST_COMPLETED)
        else:
            async with asyncio.timeout_at(loop.time() + (deadline - clock.now())):
                done, _ = await asyncio.wait((waiter, disconnected), return_when=asyncio.FIRST_COMPLETED)
    except TimeoutError:
        runtime.withdraw(items)
        waited = (clock.now() - items[0].first_enqueued_at) * 1000
        raise DeadlineExceeded(
            f"request to model '{runtime.name}' missed its deadline after {waited:.0f} ms"
        ) from None
    except asyncio.CancelledError:
        runtime.withdraw(items)
        raise
    finally:
        disconnected.cancel()
    if waiter not in done:
        runtime.withdraw(items)
        waiter.cancel()
        raise ClientGone()
    result = waiter.result()
    return [result] if len(futures) == 1 else result


def json_response(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code=status, headers=headers, media_type="application/json")
