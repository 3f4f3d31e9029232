"""Search writes through any front end of `inferd serve --frontends N`.

Each shard's log has one writer: the owner front end (front end 0). The API's write routes
(api/search_routes.py: upserts and deletes of documents, indexes created and deleted) run there; a follower front end forwards each
write, whole, to the owner over the owner channel (frontends/owner_channel.py) and answers its client
with the owner's answer: the same status and body, an error included. A follower checks a write's body
first, with the owner's own parsing (api/search_routes.py), so a bad one is its 400 and never forwarded.
While the owner is away (it died and the parent starts it again) or hung (alive but answering no ping
for a few seconds: OwnerChannel.ask_watched), a follower answers writes with 503 and Retry-After; its
searches and gets go on, from the replicas, which outlive the owner.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec
from prometheus_client import CollectorRegistry, Counter

from inferd.errors import ServingError, WorkerUnavailable, from_wire
from inferd.frontends.owner_channel import OwnerUnreachable

log = logging.getLogger("inferd.search")

KIND = "search-write"
"""The owner channel's request kind of a forwarded write."""
FORWARD_TIMEOUT_S = 150.0
"""Most a forwarded write waits for the owner's answer (an upsert's embedding may take INGEST_TIMEOUT_S),
while the owner answers pings (a hung one fails the write within HUNG_AFTER_S of owner_channel.py)."""
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
"""OwnerChannel.ask_watched."""


def forwarded_writes(registry: CollectorRegistry) -> Counter:
    """The owner's count of the writes the other front ends forwarded to it."""
    return Counter(
        "inferd_search_forwarded_writes_total",
        "Search writes the other front ends forwarded to the owner front end, by op (upsert, delete, "
        "create, drop) and outcome (ok, or the error's code).",
        ["op", "outcome"],
        registry=registry,
    )


def rebuild(code: str, message: str, retry_after_s: float | None) -> ServingError:
    """The owner's error, as this front end answers it (a 503 with no Retry-After gets the owner's)."""
    if code == WorkerUnavailable.__name__ and retry_after_s is None:
        retry_after_s = OWNER_RETRY_AFTER_S
    return from_wire(code, message, retry_after_s)


class WriteDesk:
    """The owner's side: runs the writes the followers forward (registered on the owner channel)."""

    def __init__(self, execute: Execute, forwarded: Counter) -> None:
        self.execute = execute
        self.forwarded = forwarded
        """inferd_search_forwarded_writes_total (`forwarded_writes`)."""

    async def answer(self, payload: bytes) -> bytes:
        write = msgspec.msgpack.decode(payload, type=Write)
        try:
            body, created = await self.execute(write)
        except ServingError as exc:
            self.forwarded.labels(write.op, exc.code).inc()
            retry_after = getattr(exc, "retry_after_s", None)
            return msgspec.msgpack.encode(Answer(error=(exc.code, exc.message), retry_after_s=retry_after))
        except Exception as exc:  # a bug: the follower's client gets a 500 that names it, as here
            self.forwarded.labels(write.op, "Internal").inc()
            log.exception("forwarded search write %s of index %s failed", write.op, write.index)
            return msgspec.msgpack.encode(Answer(error=("Internal", f"{type(exc).__name__}: {exc}")))
        self.forwarded.labels(write.op, "ok").inc()
        return msgspec.msgpack.encode(Answer(body, created))


class Forwarder:
    """A follower's side: hands each write to the owner and returns its answer."""

    def __init__(self, ask: Ask) -> None:
        self.ask = ask
        self.unreachable = False

    async def forward(self, write: Write) -> tuple[bytes, bool]:
        """The owner's (JSON body, created); its error raised as the same ServingError, or
        WorkerUnavailable (503, Retry-After) when the owner does not answer (down, restarting or hung)."""
        try:
            raw = await self.ask(KIND, msgspec.msgpack.encode(write), FORWARD_TIMEOUT_S)
            answer = msgspec.msgpack.decode(raw, type=Answer)
        except (OwnerUnreachable, msgspec.DecodeError) as exc:
            if not self.unreachable:
                log.warning("search writes: the owner front end does not answer (%s)", exc)
            self.unreachable = True
            raise WorkerUnavailable(
                f"index {write.index!r} takes writes through the owner front end (front end 0), which did "
                f"not answer ({exc}): it is down, restarting or hung; retry the write shortly (searches go "
                "on)",
                OWNER_RETRY_AFTER_S,
            ) from None
        if self.unreachable:
            log.info("search writes: the owner front end answers again")
        self.unreachable = False
        if answer.error is not None:
            raise rebuild(*answer.error, answer.retry_after_s)
        return answer.body, answer.created
