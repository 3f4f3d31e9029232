"""The search API's part of the OpenAPI document (api/search_routes.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
_FIELD = {"type": ["string", "integer", "number", "boolean"]}
SETTINGS = {
    "type": "object",
    "properties": {
        "shards": {"type": "integer", "minimum": 1, "maximum": 64, "default": 2},
        "replicas": {"type": "integer", "minimum": 1, "maximum": 16, "default": 2},
        "embedder": {"type": "string", "default": "minilm"},
        "dim": {"type": "integer", "default": 384},
        "fields": {
            "type": "object",
            "additionalProperties": {"enum": ["keyword", "int", "float", "bool"]},
        },
    },
}
DOCUMENTS = {
    "type": "object",
    "required": ["documents"],
    "properties": {
        "documents": {
            "type": "array",
            "minItems": 1,
            "maxItems": 1000,
            "items": {
                "type": "object",
                "required": ["id"],
                "properties": {
                    "id": {"type": "string", "minLength": 1, "maxLength": 256},
                    "text": {"type": "string"},
                    "title": {"type": "string"},
                    "fields": {"type": "object", "additionalProperties": _FIELD},
                },
            },
        }
    },
}
SEARCH = {
    "type": "object",
    "required": ["query"],
    "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 4096},
        "k": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 10},
        "mode": {"enum": ["hybrid", "lexical", "dense"], "default": "hybrid"},
        "filter": {
            "type": "object",
            "description": '{"field": value} or {"field": {"in": [values]}}, AND-ed',
        },
        "timeout_ms": {"type": "number", "minimum": 1, "maximum": 60000, "default": 1000},
        "min_seq": {"type": "array", "items": {"type": "integer"}, "description": "a write's seq"},
    },
}
HITS = {
    "type": "object",
    "properties": {
        "hits": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string"},
                    "score": {"type": "number"},
                    "title": {"type": "string"},
                },
            },
        },
        "coverage": {
            "type": "object",
            "properties": {"shards": {"type": "integer"}, "answered": {"type": "integer"}},
        },
        "degraded": {"type": "array", "items": {"type": "string"}},
        "took_ms": {"type": "number"},
    },
}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _ok(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def search_paths(responses: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    obj = {"type": "object"}
    created = {"201": _ok(obj, "Created"), "409": {"description": "Exists with other settings"}}
    return {
        "/v1/indexes": {"get": {"summary": "Every search index", "responses": responses(None, 401)}},
        "/v1/indexes/{name}": {
            "put": {
                "summary": "Create a search index, or verify its settings (idempotent)",
                "parameters": [_NAME],
                "requestBody": _body(SETTINGS),
                "responses": {**responses(_ok(obj), 400, 404, 413, 415), **created},
            },
            "get": {"summary": "An index's state", "parameters": [_NAME], "responses": responses(None, 404)},
            "delete": {
                "summary": "Delete an index",
                "parameters": [_NAME],
                "responses": responses(None, 404),
            },
        },
        "/v1/indexes/{name}/documents": {
            "post": {
                "summary": "Add or replace documents (durable when answered); the answer's seq per shard",
                "parameters": [_NAME],
                "requestBody": _body(DOCUMENTS),
                "responses": responses(None, 400, 404, 413, 415, 503),
            }
        },
        "/v1/indexes/{name}/documents/{id}": {
            "get": {
                "summary": "One document",
                "parameters": [_NAME, _ID],
                "responses": responses(None, 404, 503),
            },
            "delete": {
                "summary": "Delete one document",
                "parameters": [_NAME, _ID],
                "responses": responses(None, 404, 503),
            },
        },
        "/v1/indexes/{name}/search": {
            "post": {
                "summary": "Search (hybrid, lexical or dense); partial coverage rather than errors",
                "parameters": [_NAME],
                "requestBody": _body(SEARCH),
                "responses": responses(_ok(HITS), 400, 404, 413, 415, 503),
            }
        },
    }
