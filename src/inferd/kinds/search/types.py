"""The values the search index library and the search service exchange (msgspec Structs).

Vectors travel as bytes: float32 little-endian, L2-normalised, `dim * 4` bytes long.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from inferd.errors import BadRequest, Internal

FieldType = Literal["keyword", "int", "float", "bool"]
FieldValue = str | int | float | bool
Mode = Literal["hybrid", "lexical", "dense"]


def _default_weights() -> dict[str, float]:
    return {"lexical": 1.0, "dense": 1.0}


class IndexSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How one index is built and searched; every shard replica of the index shares it."""

    shards: int = 2
    replicas: int = 2
    embedder: str = "minilm"
    dim: int = 384
    fields: dict[str, FieldType] = msgspec.field(default_factory=dict)
    k1: float = 0.9
    b: float = 0.4
    stopwords: str = "en_plus"
    hnsw_m: int = 32
    ef_construction: int = 200
    ef_search: int = 128
    rrf_k: int = 60
    weights: dict[str, float] = msgspec.field(default_factory=_default_weights)


class Document(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    text: str
    title: str = ""
    fields: dict[str, FieldValue] = msgspec.field(default_factory=dict)


def content_digest(doc: Document) -> bytes:
    """What a re-embed's vector was computed from (a Revector applies only while it still matches)."""
    return hashlib.blake2b(f"{doc.title}\n{doc.text}".encode(), digest_size=16).digest()


class Upsert(msgspec.Struct, frozen=True, kw_only=True, tag="upsert"):
    """Insert or replace the document with this id. `vector`: float32 LE, L2-normalised, dim*4 bytes.
    `next_vector`: its vector by the embedder version a re-embed is moving to (kept while one runs)."""

    doc: Document
    vector: bytes | None = None
    next_vector: bytes | None = None


class Delete(msgspec.Struct, frozen=True, kw_only=True, tag="delete"):
    id: str


class Revector(msgspec.Struct, frozen=True, kw_only=True, tag="revector"):
    """A re-embed's vector for the live document `id`, kept only while its content still has `digest`
    (a document changed since it was read came with its own next_vector)."""

    id: str
    digest: bytes
    vector: bytes


class Reembed(msgspec.Struct, frozen=True, kw_only=True, tag="reembed"):
    """A re-embed of the shard's vectors by embedder `version`: "begin" opens the next vector space,
    "promote" makes it the one searched, "abandon" drops it."""

    action: Literal["begin", "promote", "abandon"]
    version: int


Op = Upsert | Delete | Revector | Reembed


class UnvectoredPage(msgspec.Struct, frozen=True, kw_only=True):
    """A page of live documents without a vector in the re-embed's space (ShardIndex.unvectored)."""

    docs: list[Document]
    cursor: int
    """Where the next page starts (a slot; slots renumber on compaction, so a re-embed repeats its
    passes until one finds nothing)."""
    done: bool
    dense_version: int
    """The embedder version of the vectors searched (0: none recorded)."""


class LogEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One step of a shard's log: seq is 1, 2, 3 ... per shard, with no gaps."""

    seq: int
    ops: list[Op]


class FieldCondition(msgspec.Struct, frozen=True, kw_only=True):
    """The document's `field` equals one of `values`."""

    field: str
    values: tuple[FieldValue, ...]


class Filter(msgspec.Struct, frozen=True, kw_only=True):
    """Conditions AND-ed together (built by filters.parse_filter)."""

    conditions: tuple[FieldCondition, ...] = ()


class ShardQuery(msgspec.Struct, frozen=True, kw_only=True):
    text: str = ""
    vector: bytes | None = None
    k: int = 10
    mode: Mode = "hybrid"
    filter: Filter | None = None


class ShardHit(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    score: float
    title: str = ""


class ShardResult(msgspec.Struct, frozen=True, kw_only=True):
    """Top-k of each list on one shard, best first; a list the mode does not ask for is empty."""

    lexical: list[ShardHit]
    dense: list[ShardHit]
    applied_seq: int


class InvalidFilter(BadRequest):
    """A filter that names an unknown field, has a value of the wrong type, or has a bad shape."""


class SeqGap(Internal):
    """A log entry arrived whose seq is not applied_seq + 1: an entry in between is missing."""

    def __init__(self, message: str, applied_seq: int, got: int) -> None:
        super().__init__(message)
        self.applied_seq = applied_seq
        self.got = got


class CorruptSnapshot(Internal):
    """A snapshot directory that is missing files or whose contents do not check out."""


class CorruptLog(Internal):
    """A write-ahead log file whose header is not ours (a torn tail is cut, never reported)."""
