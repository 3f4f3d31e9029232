"""Search writes through any front end, on one host or many.

Each index's shard logs have one writer: the front end that holds the index's writer lease
(kinds/search/writers.py). Indexes are created and deleted by the holder of the `decider` lease
(cluster/lease.py), which writes the one `kind/search/indexes` document of the whole server
(kinds/search/shared_indexes.py). The API's write routes (api/search_routes.py: upserts and deletes of
documents, indexes created and deleted) run on that front end; any other one forwards the write,
whole, to it over the front ends' channel (frontends/channel.py: its Unix socket on one host, TCP to the
address in its record `frontend/<id>` across hosts, with the cluster's join token) and answers its
client with that front end's answer: the same status and body, an error included. The forwarding front
end checks the caller and the write's body first, with the writer's own parsing
(api/search_routes.py), so a bad one is its own 400 and never forwarded. A front end that is asked to
run a write it does not own (the lease moved meanwhile) refuses it with 503 and Retry-After; it never
forwards it again.

While there is no writer (its lease is free, or a takeover runs), a write answers 503 with Retry-After
(about the lease's ttl); while the writer is away (it died and nobody took over yet) or hung (alive but
answering no ping for a few seconds: FrontendChannel.ask_watched), 503 with Retry-After too. Searches
and gets go on, from the replicas.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter

from inferd.errors import ServingError, WorkerUnavailable, from_wire
from inferd.frontends.channel import PeerUnreachable

log = logging.getLogger("inferd.search")

KIND = "search-write"
"""The channel's request kind of a forwarded write."""
FORWARD_TIMEOUT_S = 150.0
"""Most a forwarded write waits for the writer's answer (an upsert's embedding may take INGEST_TIMEOUT_S),
while the writer answers pings (a hung one fails the write within HUNG_AFTER_S of channel.py)."""
AWAY_RETRY_AFTER_S = 1.0
"""The Retry-After of a write refused while its writer does not answer (restarted, or replaced within
the lease's ttl)."""
INDEX_OPS = frozenset({"create", "drop"})
"""The writes the holder of the `decider` lease runs (the others: the index's writer)."""


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


class Writer(Protocol):
    """Who writes an index (kinds/search/writers.py's IndexWriter answers these)."""

    def writes(self) -> bool:
        """This front end writes the index now."""
        ...

    def writer(self) -> str | None:
        """The id of the front end that writes it now; None while none is known."""
        ...

    def retry_after_s(self) -> float:
        """How long a write refused while there is no writer should wait."""
        ...

    def taking_over(self) -> int | None:
        """The epoch of this front end's grant while its takeover runs (it writes nothing yet); None
        otherwise."""
        ...


class Nobody(msgspec.Struct, frozen=True):
    """No front end runs the write now: it is refused with 503, Retry-After `retry_after_s`."""

    why: str
    retry_after_s: float


HERE = ""
"""The route of a write this front end runs (`route_index_op`, `route_document`)."""


def route_index_op(decider: str | None, me: str) -> str | Nobody:
    """Where an index is created or deleted: HERE, another front end's id, or Nobody. `decider`: the id
    of the `decider` lease's holder (None: none holds it)."""
    if decider is None:
        return Nobody("no front end holds the lease of the server's decisions now", AWAY_RETRY_AFTER_S)
    return HERE if decider == me else decider


def route_document(write: Write, writer: Writer, me: str) -> str | Nobody:
    """Where a document write runs: HERE, another front end's id, or Nobody. `writer`: its index's."""
    if writer.writes():
        return HERE
    who = writer.writer()
    if who is None or who == me:  # (this one named while it does not write: its takeover runs)
        return Nobody(f"index {write.index!r} has no writer now (its lease is being taken over)", writer.retry_after_s())
    return who


def refusal(nobody: Nobody) -> WorkerUnavailable:
    return WorkerUnavailable(f"{nobody.why}: retry the write shortly (searches go on)", nobody.retry_after_s)


Execute = Callable[[Write], Awaitable[tuple[bytes, bool]]]
"""Runs a write here: (the answer's JSON body, whether it created something)."""
Ask = Callable[[str, str, bytes, float], Awaitable[bytes]]
"""FrontendChannel.ask_watched: (address, kind, payload, timeout_s) -> answer."""


def forwarded_writes(registry: CollectorRegistry) -> Counter:
    """The count of the writes the other front ends forwarded to this one."""
    return Counter(
        "inferd_search_forwarded_writes_total",
        "Search writes the other front ends forwarded to this one (it writes the index, or holds the "
        "lease of the server's decisions for indexes created and deleted), by op (upsert, delete, create, "
        "drop) and outcome (ok, or the error's code).",
        ["op", "outcome"],
        registry=registry,
    )


def rebuild(code: str, message: str, retry_after_s: float | None) -> ServingError:
    """The writer's error, as this front end answers it (a 503 with no Retry-After gets one)."""
    if code == WorkerUnavailable.__name__ and retry_after_s is None:
        retry_after_s = AWAY_RETRY_AFTER_S
    return from_wire(code, message, retry_after_s)


class WriteDesk:
    """The side a write is forwarded to: runs it (registered on the channel as KIND)."""

    def __init__(self, execute: Execute, forwarded: Counter) -> None:
        self.execute = execute
        """Runs a forwarded write, or refuses it (503) when this front end does not own it (any more)."""
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
        except Exception as exc:  # a bug: the asking front end's client gets a 500 that names it, as here
            self.forwarded.labels(write.op, "Internal").inc()
            log.exception("forwarded search write %s of index %s failed", write.op, write.index)
            return msgspec.msgpack.encode(Answer(error=("Internal", f"{type(exc).__name__}: {exc}")))
        self.forwarded.labels(write.op, "ok").inc()
        return msgspec.msgpack.encode(Answer(body, created))


class Forwarder:
    """The forwarding side: hands a write to the front end that runs it and returns its answer."""

    def __init__(self, ask: Ask, address_of: Callable[[str], str | None]) -> None:
        self.ask = ask
        self.address_of = address_of
        """A front end's channel address by its id (None: not known, e.g. its record expired)."""
        self.unreachable: set[str] = set()
        """The front ends whose last forward found them away (logged once)."""

    async def forward(self, write: Write, to: str) -> tuple[bytes, bool]:
        """Front end `to`'s (JSON body, created); its error raised as the same ServingError, or
        WorkerUnavailable (503, Retry-After) when it does not answer (down, restarting or hung)."""
        role = "holds the lease of the server's decisions" if write.op in INDEX_OPS else "writes the index"
        address = self.address_of(to)
        try:
            if address is None:
                raise PeerUnreachable(
                    "its record names no address to reach it by from here (it is down, or it listens on no "
                    "TCP: that needs a join token, and plain TCP on its worker port)"
                )
            raw = await self.ask(address, KIND, msgspec.msgpack.encode(write), FORWARD_TIMEOUT_S)
            answer = msgspec.msgpack.decode(raw, type=Answer)
        except (PeerUnreachable, msgspec.DecodeError) as exc:
            if to not in self.unreachable:
                log.warning("search writes: front end %s (it %s) does not answer (%s)", to, role, exc)
            self.unreachable.add(to)
            raise WorkerUnavailable(
                f"index {write.index!r}: front end {to!r} {role}, and it did not answer ({exc}): it is "
                "down, restarting or hung; retry the write shortly (searches go on)",
                AWAY_RETRY_AFTER_S,
            ) from None
        if to in self.unreachable:
            log.info("search writes: front end %s answers again", to)
            self.unreachable.discard(to)
        if answer.error is not None:
            raise rebuild(*answer.error, answer.retry_after_s)
        return answer.body, answer.created
