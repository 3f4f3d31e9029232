"""A search index's typed settings: model.toml's `[search]` table, or a PUT /v1/indexes/{name} body.

    name = "docs"
    kind = "search"
    [search]
    shards = 2
    replicas = 2
    embedder = "minilm"      # a batch model with an EMBEDDING output; "none": lexical only
    fields = { lang = "keyword", year = "int" }

Checked at start (the kind's params model) and on every PUT; an omitted setting takes its default.
"""

from __future__ import annotations

from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from inferd.config import ModelConfig, describe_validation_error
from inferd.errors import BadRequest
from inferd.kinds.search.types import FieldType, IndexSettings

NO_EMBEDDER = "none"
"""`embedder = "none"`: a lexical-only index (no vectors, no dense or hybrid search)."""
DEFAULT_WEIGHTS = {"lexical": 1.0, "dense": 2.0}
"""Reciprocal rank fusion counts a dense rank twice a lexical one: chosen on Cranfield alone (the best
nDCG@10 of dense weights 1, 1.25, 1.5, 2, 3) and checked on CISI and MEDLINE (docs/search.md)."""
IMPLEMENTATION = "inferd.kinds.search.replica"
"""What a search model's workers run: shard replicas (worker/main.py hands them the connection)."""


class SearchParams(BaseModel):
    """The `[search]` table (a search model's params)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shards: int = Field(default=2, ge=1, le=64)
    """Documents are spread over this many shards by a hash of their id."""
    replicas: int = Field(default=2, ge=1, le=8)
    """Worker processes holding a copy of each shard (the index runs shards x replicas processes; the
    API caps that product per machine: kinds/search/indexes.py)."""
    embedder: str = Field(default="minilm", min_length=1, max_length=64)
    """The batch model that embeds documents and queries (its EMBEDDING output); "none": lexical only."""
    dim: int = Field(default=384, ge=1, le=4096)
    """The embedder's vector length."""
    fields: dict[str, FieldType] = Field(default_factory=dict)
    """Filterable document fields and their types (keyword, int, float, bool)."""
    k1: float = Field(default=0.9, gt=0.0, le=10.0)
    b: float = Field(default=0.4, ge=0.0, le=1.0)
    stopwords: str = "en_plus"
    hnsw_m: int = Field(default=32, ge=4, le=128)
    ef_construction: int = Field(default=200, ge=8, le=2000)
    ef_search: int = Field(default=128, ge=8, le=4096)
    rrf_k: int = Field(default=60, ge=1, le=1000)
    weights: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    """Fusion weights of the lexical and dense lists (reciprocal rank fusion); an omitted one is the
    default's."""
    snapshot_every: int = Field(default=1000, ge=1, le=10_000_000)
    """Log entries between a shard's snapshots (after one, the write-ahead log before it is dropped)."""

    @field_validator("fields")
    @classmethod
    def _field_names(cls, value: dict[str, FieldType]) -> dict[str, FieldType]:
        bad = [n for n in value if not n or len(n) > 64 or not n.replace("_", "a").isalnum()]
        if bad:
            raise ValueError(f"field names {bad} must be 1-64 letters, digits or underscores")
        return value

    @field_validator("weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        if set(value) - {"lexical", "dense"} or any(w < 0 for w in value.values()):
            raise ValueError(f"weights {value} must be non-negative and name only lexical and dense")
        return {**DEFAULT_WEIGHTS, **value}

    @property
    def lexical_only(self) -> bool:
        return self.embedder == NO_EMBEDDER

    def settings(self) -> IndexSettings:
        """The index library's view of these settings."""
        data = self.model_dump(exclude={"snapshot_every"})
        return msgspec.convert(data, IndexSettings)


def parse_params(raw: object, what: str) -> SearchParams:
    """Settings from a request body or a stored index file; BadRequest naming each problem."""
    if not isinstance(raw, dict):
        raise BadRequest(f"{what} must be a JSON object of index settings, got {type(raw).__name__}")
    try:
        return SearchParams.model_validate(raw)
    except ValidationError as exc:
        raise BadRequest(describe_validation_error(what, exc)) from None


def index_config(name: str, params: SearchParams, **overrides: Any) -> ModelConfig:
    """The model config of a search index: one worker per shard replica."""
    return ModelConfig(
        name=name,
        kind="search",
        implementation=IMPLEMENTATION,
        workers=params.shards * params.replicas,
        params=params.model_dump(),
        **overrides,
    )


def search_config(name: str | None = None, **overrides: Any) -> ModelConfig:
    """A model.toml with `kind = "search"`: its `[search]` table (or params) are the index settings."""
    table = {**overrides.pop("params", {}), **overrides.pop("search", {})}
    params = SearchParams.model_validate(table)
    overrides.pop("implementation", None)
    overrides.pop("workers", None)
    return index_config(name or "search", params, **overrides)


def params_of(config: ModelConfig) -> SearchParams:
    return SearchParams.model_validate(config.params)
