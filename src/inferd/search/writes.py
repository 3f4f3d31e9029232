"""Search writes through any front end of `inferd serve --frontends N`.

Each shard's log has one writer: the owner front end (front end 0). The API's write routes
(api/search_routes.py: upserts and deletes of documents, indexes created and deleted) run there; a follower front end forwards each
write, whole, to the owner over the owner channel (frontends/owner_channel.py) and answers its client
with the owner's answer: the same status and body, an error included. While the owner is away (it died
and the parent starts it again), a follower answers writes with 503 and Retry-After; its searches and
gets go on, from the replicas, which outlive the owner.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec

from inferd.errors import ServingError, WorkerUnavailable, from_wire
from inferd.frontends.owner_channel import OwnerUnreachable

log = logging.getLogger("inferd.search")

KIND = "search-write"
"""The owner channel's request kind of a forwarded write."""
FORWARD_TIMEOUT_S = 150.0
"""Most a forwarded write waits for the owner's answer (an upsert's embedding may take INGEST_TIMEOUT_S)."""
OWNER_RETRY_AFTER_S = 1.0
"""The Retry-After of a write refused while the owner is away (the parent restarts it in about that)."""


class Write(msgspec.Struct, frozen=True):
    op: str
    """"upsert" (body: the request's JSON body), "delete" (key: the document's id), "create" (body: the
    index settings) or "drop" (the index)."""
    index: str
    key: str = ""
    body: bytes = b""


class Answer(msgspec.Struct, frozen=True):
    body: bytes = b""
    """The JSON body of the answer (when no error)."""
    created: bool = False
    error: tuple[str, str] | None = None
    """(code, message) of the error the write failed with."""
    retry_after_s: float | None = None


Execute = Callable[[Write], Awaitable[tuple[bytes, bool]]]
"""Runs a write on the owner: (the answer's JSON body, whether it created something)."""
Ask = Callable[[str, bytes, float], Awaitable[bytes]]
"""OwnerChannel.ask."""


def rebuild(code: str, message: str, retry_after_s: float | None) -> ServingError:
    """The owner's error, as this front end answers it (a 503 with no Retry-After gets the owner's)."""
    if code == WorkerUnavailable.__name__ and retry_after_s is None:
        retry_after_s = OWNER_RETRY_AFTER_S
    return from_wire(code, message, retry_after_s)


class WriteDesk:
    """The owner's side: runs the writes the followers forward (registered on the owner channel)."""

    def __init__(self, execute: Execute) -> None:
        self.execute = execute
        self.forwarded = 0

    async def answer(self, payload: bytes) -> bytes:
        write = msgspec.msgpack.decode(payload, type=Write)
        self.forwarded += 1
        try:
            body, created = await self.execute(write)
        except ServingError as exc:
            retry_after = getattr(exc, "retry_after_s", None)
            return msgspec.msgpack.encode(Answer(error=(exc.code, exc.message), retry_after_s=retry_after))
        except Exception as exc:  # a bug: the follower's client gets a 500 that names it, as here
            log.exception("forwarded search write %s of index %s failed", write.op, write.index)
            return msgspec.msgpack.encode(Answer(error=("Internal", f"{type(exc).__name__}: {exc}")))
        return msgspec.msgpack.encode(Answer(body, created))


class Forwarder:
    """A follower's side: hands each write to the owner and returns its answer."""

    def __init__(self, ask: Ask) -> None:
        self.ask = ask
        self.unreachable = False

    async def forward(self, write: Write) -> tuple[bytes, bool]:
        """The owner's (JSON body, created); its error raised as the same ServingError, or
        WorkerUnavailable (503, Retry-After) when the owner does not answer."""
        try:
            raw = await self.ask(KIND, msgspec.msgpack.encode(write), FORWARD_TIMEOUT_S)
            answer = msgspec.msgpack.decode(raw, type=Answer)
        except (OwnerUnreachable, msgspec.DecodeError) as exc:
            if not self.unreachable:
                log.warning("search writes: the owner front end does not answer (%s)", exc)
            self.unreachable = True
            raise WorkerUnavailable(
                f"index {write.index!r} takes writes through the owner front end (front end 0), which did "
                f"not answer ({exc}): it is down or restarting; retry the write shortly (searches go on)",
                OWNER_RETRY_AFTER_S,
            ) from None
        if self.unreachable:
            log.info("search writes: the owner front end answers again")
        self.unreachable = False
        if answer.error is not None:
            raise rebuild(*answer.error, answer.retry_after_s)
        return answer.body, answer.created
