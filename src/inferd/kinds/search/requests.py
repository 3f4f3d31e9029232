"""The search API's request bodies, checked: every problem is a BadRequest (or PayloadTooLarge) that
names it. A rejected document batch writes nothing: the whole batch is checked before any of it is
embedded or logged."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from inferd.errors import BadRequest, PayloadTooLarge
from inferd.kinds.search.filters import parse_filter
from inferd.kinds.search.types import Document, FieldType, Filter, Mode

MAX_K = 1000
MAX_QUERY_CHARS = 4096
MAX_BATCH_DOCUMENTS = 1000
MAX_DOCUMENT_CHARS = 1_000_000
MAX_ID_CHARS = 256
DEFAULT_TIMEOUT_MS = 1000.0
MAX_TIMEOUT_MS = 60_000.0
MODES: tuple[Mode, ...] = ("hybrid", "lexical", "dense")
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "keyword": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
}


@dataclass(frozen=True, slots=True)
class SearchRequest:
    query: str
    k: int
    mode: Mode
    filter: Filter | None
    filter_key: str
    """The filter as canonical JSON (a result cache key part)."""
    timeout_ms: float
    min_seq: tuple[int, ...] | None
    """Read-your-writes: only replicas that applied at least these seqs (per shard) answer if any can."""
    cache: bool = True
    """False: answer without the result cache (query vectors are still cached), e.g. to measure search."""


def json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        raw = msgspec.json.decode(body) if body.strip() else {}
    except msgspec.DecodeError as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise BadRequest(f"{what} must be a JSON object, got {type(raw).__name__}")
    return raw


def parse_search(
    body: bytes, fields: dict[str, FieldType], shards: int, header_timeout_ms: float | None = None
) -> SearchRequest:
    """A search request's body; `header_timeout_ms` (X-Request-Timeout-Ms) bounds its time as the body's
    "timeout_ms" does, and when both are given the smaller wins."""
    raw = json_object(body, "search request")
    unknown = sorted(set(raw) - {"query", "k", "mode", "filter", "timeout_ms", "min_seq", "cache"})
    if unknown:
        raise BadRequest(
            f"search request has unknown keys {unknown}: use query, k, mode, filter, timeout_ms, min_seq, cache"
        )
    cache = raw.get("cache", True)
    if not isinstance(cache, bool):
        raise BadRequest(f'"cache" must be true or false, got {cache!r}')
    query = raw.get("query")
    if not isinstance(query, str) or not query.strip():
        raise BadRequest('"query" must be a non-empty string')
    if len(query) > MAX_QUERY_CHARS:
        raise BadRequest(f'"query" is {len(query)} characters; the limit is {MAX_QUERY_CHARS}')
    k = raw.get("k", 10)
    if not _is_int(k) or not 1 <= k <= MAX_K:
        raise BadRequest(f'"k" must be a whole number from 1 to {MAX_K}, got {k!r}')
    mode = raw.get("mode", "hybrid")
    if mode not in MODES:
        raise BadRequest(f'"mode" must be one of {list(MODES)}, got {mode!r}')
    timeout_ms = raw.get("timeout_ms", DEFAULT_TIMEOUT_MS if header_timeout_ms is None else MAX_TIMEOUT_MS)
    if not isinstance(timeout_ms, int | float) or isinstance(timeout_ms, bool):
        raise BadRequest(f'"timeout_ms" must be a number, got {timeout_ms!r}')
    if not 1 <= timeout_ms <= MAX_TIMEOUT_MS:
        raise BadRequest(f'"timeout_ms" must be from 1 to {MAX_TIMEOUT_MS:.0f}, got {timeout_ms}')
    if header_timeout_ms is not None:
        if not 1 <= header_timeout_ms <= MAX_TIMEOUT_MS:
            raise BadRequest(
                f"X-Request-Timeout-Ms must be from 1 to {MAX_TIMEOUT_MS:.0f} on a search, got {header_timeout_ms}"
            )
        timeout_ms = min(timeout_ms, header_timeout_ms)
    raw_filter = raw.get("filter")
    parsed = None if raw_filter is None else parse_filter(raw_filter, fields)
    return SearchRequest(
        query,
        k,
        mode,
        parsed,
        json.dumps(raw_filter, sort_keys=True),
        float(timeout_ms),
        _min_seq(raw.get("min_seq"), shards),
        cache,
    )


def _min_seq(raw: Any, shards: int) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != shards or not all(_is_int(s) and s >= 0 for s in raw):
        raise BadRequest(
            f'"min_seq" must be the "seq" list a write returned: {shards} whole numbers, got {raw!r}'
        )
    return tuple(raw)


def parse_documents(body: bytes, fields: dict[str, FieldType]) -> list[Document]:
    raw = json_object(body, "documents request")
    docs = raw.get("documents")
    if set(raw) - {"documents"}:
        raise BadRequest(f"documents request has unknown keys {sorted(set(raw) - {'documents'})}")
    if not isinstance(docs, list) or not docs:
        raise BadRequest('"documents" must be a non-empty list of {"id", "text", "title", "fields"}')
    if len(docs) > MAX_BATCH_DOCUMENTS:
        raise PayloadTooLarge(
            f"a batch holds at most {MAX_BATCH_DOCUMENTS} documents, got {len(docs)}: split it"
        )
    out: list[Document] = []
    seen: dict[str, int] = {}
    for i, doc in enumerate(docs):
        d = _document(doc, i, fields)
        if d.id in seen:
            raise BadRequest(f"documents[{seen[d.id]}] and documents[{i}] have the same id {d.id!r}")
        seen[d.id] = i
        out.append(d)
    return out


def _document(raw: Any, i: int, fields: dict[str, FieldType]) -> Document:
    where = f"documents[{i}]"
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"id", "text", "title", "fields"})
    if unknown:
        raise BadRequest(f"{where} has unknown keys {unknown}: use id, text, title, fields")
    doc_id = raw.get("id")
    if not isinstance(doc_id, str) or not doc_id or len(doc_id) > MAX_ID_CHARS:
        raise BadRequest(f"{where} needs an id: a string of 1 to {MAX_ID_CHARS} characters, got {doc_id!r}")
    text, title = raw.get("text", ""), raw.get("title", "")
    if not isinstance(text, str) or not isinstance(title, str):
        raise BadRequest(f"{where} (id {doc_id!r}): text and title must be strings")
    if len(text) + len(title) > MAX_DOCUMENT_CHARS:
        raise PayloadTooLarge(f"{where} (id {doc_id!r}) is over {MAX_DOCUMENT_CHARS} characters")
    values = raw.get("fields", {})
    if not isinstance(values, dict):
        raise BadRequest(f"{where} (id {doc_id!r}): fields must be an object")
    for name, value in values.items():
        kind = fields.get(name)
        if kind is None:
            raise BadRequest(
                f"{where} (id {doc_id!r}) has field {name!r}, which the index does not declare "
                f"(declared: {sorted(fields)})"
            )
        if not isinstance(value, _FIELD_TYPES[kind]) or (kind != "bool" and isinstance(value, bool)):
            raise BadRequest(f"{where} (id {doc_id!r}): field {name!r} is {kind}, got {value!r}")
    return Document(id=doc_id, text=text, title=title, fields=values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
