"""How search values travel inside the worker protocol's shard messages: MessagePack bytes (msgspec),
so the protocol module does not depend on the index library's types."""

from __future__ import annotations

import msgspec

from inferd.kinds.search.types import (
    Document,
    IndexSettings,
    LogEntry,
    ShardQuery,
    ShardResult,
    UnvectoredPage,
)

ANNOUNCE = -1
"""The call_id of a replica's note to its reading links: ShardReply(ANNOUNCE, applied_seq, documents,
body=the shard as MessagePack, -1 while it loads one)."""

_enc = msgspec.msgpack.Encoder()
_entries = msgspec.msgpack.Decoder(list[LogEntry])
_query = msgspec.msgpack.Decoder(ShardQuery)
_result = msgspec.msgpack.Decoder(ShardResult)
_document = msgspec.msgpack.Decoder(Document | None)
_settings = msgspec.msgpack.Decoder(IndexSettings)
_int = msgspec.msgpack.Decoder(int)
_str = msgspec.msgpack.Decoder(str)
_page = msgspec.msgpack.Decoder(UnvectoredPage)
_pair = msgspec.msgpack.Decoder(tuple[int, int])
_piece = msgspec.msgpack.Decoder(tuple[int, int, bytes])


def encode(value: object) -> bytes:
    return _enc.encode(value)


def entries(body: bytes) -> list[LogEntry]:
    return _entries.decode(body)


def query(body: bytes) -> ShardQuery:
    return _query.decode(body)


def result(body: bytes) -> ShardResult:
    return _result.decode(body)


def document(body: bytes) -> Document | None:
    return _document.decode(body)


def settings(body: bytes) -> IndexSettings:
    return _settings.decode(body)


def number(body: bytes) -> int:
    return _int.decode(body)


def text(body: bytes) -> str:
    return _str.decode(body)


def page(body: bytes) -> UnvectoredPage:
    return _page.decode(body)


def pair(body: bytes) -> tuple[int, int]:
    return _pair.decode(body)


def piece(body: bytes) -> tuple[int, int, bytes]:
    """A "snapshot" call's answer: (the snapshot's seq, its packed size, the bytes from the offset asked)."""
    return _piece.decode(body)
