"""The OpenAPI 3.1 document of the whole HTTP API, built from the same msgspec types the handlers use."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from inferd import __version__
from inferd.api.completions import ChatRequest, CompletionRequest
from inferd.api.oip import InferRequest, InferResponse
from inferd.api.openai import EmbeddingsRequest
from inferd.api.repository import INDEX, LOAD, UNLOAD, ControlRequest, IndexRequest
from inferd.api.search_openapi import search_paths
from inferd.fleet.repository_index import IndexRow

_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string"}, "request_id": {"type": ["string", "null"]}},
    "required": ["error"],
}
"""An error of the OIP routes (and of /metrics, /openapi.json): {"error": message, "request_id": id}."""
_OPENAI_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
                "request_id": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}
"""An error of the OpenAI routes (/v1/...), in OpenAI's shape."""


def _json_body(ref: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}


def _responses(
    ok: dict[str, Any] | None = None, *codes: int, error: dict[str, Any] = _ERROR
) -> dict[str, Any]:
    out: dict[str, Any] = {"200": ok or {"description": "OK"}}
    texts = {
        400: "Bad request (the message names the problem)",
        401: "Missing, unknown or expired API key (only when tenants are configured; WWW-Authenticate set)",
        403: "The caller's tenant may not use this model",
        404: "Unknown model or version",
        409: "Model control with several front ends is not supported yet",
        413: "Body too large",
        415: "Unsupported content type",
        422: "The model failed on this input",
        429: "Queue full or deadline cannot be met (Retry-After set)",
        503: "No ready worker",
        504: "Deadline exceeded",
    }
    if codes and 404 in codes:  # every model route is keyed, and limited to the tenant's models
        codes = (*codes, 401, 403)
    for code in sorted(set(codes)):
        out[str(code)] = {"description": texts[code], "content": {"application/json": {"schema": error}}}
    return out


def _model_params(version: bool) -> list[dict[str, Any]]:
    params = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    if version:
        params.append({"name": "version", "in": "path", "required": True, "schema": {"type": "string"}})
    return params


@cache
def openapi_document() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        (InferRequest, InferResponse, EmbeddingsRequest, CompletionRequest, ChatRequest, IndexRequest, ControlRequest, IndexRow),
        ref_template="#/components/schemas/{name}",
    )
    infer = {
        "summary": "Run inference (KServe OIP v2; Triton binary tensor extension supported)",
        "requestBody": _json_body("#/components/schemas/InferRequest"),
        "responses": _responses(
            {
                "description": "Outputs with the lifecycle record in `parameters` and X-Inferd-* headers",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/InferResponse"}}},
            },
            400,
            404,
            413,
            415,
            422,
            429,
            503,
            504,
        ),
    }
    health = {"responses": {"200": {"description": "true"}, "503": {"description": "false"}}}
    model_health = {"responses": {**_responses(None, 404), **health["responses"]}}
    text = (400, 404, 413, 415, 422, 429, 503, 504)
    paths: dict[str, Any] = {
        "/v2/health/live": {"get": {"summary": "Server live", "security": [], **health}},
        "/v2/health/ready": {
            "get": {"summary": "Server ready (every model kept warm has a ready worker; those served on demand count apart)", "security": [], **health}
        },
        "/v2": {"get": {"summary": "Server metadata", "responses": _responses(None, 401)}},
        "/v1/models": {
            "get": {
                "summary": "Every model the caller may use (OpenAI shape)",
                "responses": _responses(None, 401, error=_OPENAI_ERROR),
            }
        },
        "/openapi.json": {"get": {"summary": "This document", "security": [], "responses": _responses()}},
        "/v1/embeddings": {
            "post": {
                "summary": "Sentence embeddings (OpenAI shape)",
                "requestBody": _json_body("#/components/schemas/EmbeddingsRequest"),
                "responses": _responses(None, 400, 404, 413, 415, 429, 503, 504, error=_OPENAI_ERROR),
            }
        },
        "/v1/completions": {
            "post": {
                "summary": "Text completion (OpenAI shape); `stream: true` answers Server-Sent Events",
                "requestBody": _json_body("#/components/schemas/CompletionRequest"),
                "responses": _responses(None, *text, error=_OPENAI_ERROR),
            }
        },
        "/v1/chat/completions": {
            "post": {
                "summary": "Chat completion (OpenAI shape); `stream: true` answers Server-Sent Events",
                "requestBody": _json_body("#/components/schemas/ChatRequest"),
                "responses": _responses(None, *text, error=_OPENAI_ERROR),
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (keyed only with [gateway] metrics_require_key = true)",
                "responses": _responses(None, 401),
            }
        },
    }
    for version in (False, True):
        base = "/v2/models/{model}" + ("/versions/{version}" if version else "")
        params = _model_params(version)
        paths[base] = {
            "get": {"summary": "Model metadata", "parameters": params, "responses": _responses(None, 404)}
        }
        paths[base + "/ready"] = {"get": {"summary": "Model ready", "parameters": params, **model_health}}
        paths[base + "/infer"] = {"post": {**infer, "parameters": params}}
    paths.update(search_paths(_responses))
    paths.update(_repository_paths())
    return {
        "openapi": "3.1.0",
        "info": {"title": "inferd", "version": __version__},
        "paths": paths,
        # With tenants configured, a key as a bearer token or in X-API-Key; without, none ({}).
        "security": [{}, {"bearer": []}, {"apiKey": []}],
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
            },
        },
    }


def _repository_paths() -> dict[str, Any]:
    """Triton's repository extension (api/repository.py): the index, load and unload. Load and unload need
    the admin token or a tenant with model_control = true (403 otherwise)."""

    def body(name: str) -> dict[str, Any]:
        return {**_json_body(f"#/components/schemas/{name}"), "required": False}

    index = {
        "description": "The repository's models the caller may call: each served version's state and reason",
        "content": {"application/json": {"schema": {"type": "array", "items": {"$ref": "#/components/schemas/IndexRow"}}}},
    }
    done = {"description": "Done: served (load), or drained and no longer served (unload)", "content": {"application/json": {"schema": {"type": "object"}}}}
    control = {"parameters": _model_params(False), "requestBody": body("ControlRequest")}
    return {
        INDEX: {"post": {"summary": "Repository index", "requestBody": body("IndexRequest"), "responses": _responses(index, 400, 401, 413)}},
        LOAD: {"post": {"summary": "Load a model from the repository", **control, "responses": _responses(done, 400, 404, 409, 413, 503)}},
        UNLOAD: {"post": {"summary": "Unload a model (its requests in flight drain first)", **control, "responses": _responses(done, 400, 404, 409, 413, 503)}},
    }
