"""The HTTP app in-process for the fuzz tests: a raw ASGI call, and a check of each answer against the
OpenAPI document the server serves (its status is listed, its JSON body matches the listed schema)."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from inferd.api.app import create_app
from inferd.api.asgi import AsgiApp
from inferd.api.openapi import openapi_document
from inferd.config import ServerConfig
from inferd.kinds.llm.sim_llm import sim_llm_config
from inferd.models.sim import sim_config
from inferd.server import InferenceServer

MODELS = ("sim", "sim-llm")
MAX_BODY_BYTES = 1024
"""The smallest body limit a server takes, so fuzzed bodies reach the 413 path too."""


def make_app() -> AsgiApp:
    """The whole front end with the embedded sim and sim-llm models and no workers: every request is
    parsed and checked as in production, then answered 503 (no ready worker) if it got that far."""
    config = ServerConfig(admin_port=None, workers=0, max_body_bytes=MAX_BODY_BYTES)
    server = InferenceServer(config, [sim_config(), sim_llm_config()], spawn_workers=False)
    return create_app(server)


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


async def call(
    app: AsgiApp,
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[tuple[bytes, bytes]] | None = None,
    cuts: list[int] | None = None,
) -> Answer:
    """One request through the ASGI app; the body is sent in one message with its Content-Length, or
    cut at `cuts` into several messages without one (chunked transfer)."""
    marks = sorted({min(c, len(body)) for c in cuts or []})
    pieces = [body[a:b] for a, b in zip([0, *marks], [*marks, len(body)], strict=True)]
    out: dict[str, Any] = {"body": b""}
    length = [] if cuts else [(b"content-length", str(len(body)).encode())]  # cut: sent chunked

    async def receive() -> dict[str, Any]:
        if pieces:
            piece = pieces.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(pieces)}
        await asyncio.Event().wait()  # the client never leaves during the call
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = dict(message["headers"])
        else:
            out["body"] += message.get("body", b"")

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [*length, *(headers or [])],
    }
    async with asyncio.timeout(10):
        await app(scope, receive, send)
    return Answer(out["status"], out["headers"], out["body"])


_DOC = openapi_document()
_REGISTRY = Registry().with_resource("urn:inferd", DRAFT202012.create_resource(_DOC))
_TEMPLATES = [(re.compile("^" + re.sub(r"\{\w+\}", "[^/]+", p) + "$"), p) for p in _DOC["paths"]]


def operation(method: str, path: str) -> dict[str, Any]:
    for regex, template in _TEMPLATES:
        if regex.match(path) and method.lower() in _DOC["paths"][template]:
            return _DOC["paths"][template][method.lower()]
    raise AssertionError(f"{method} {path} is not in the OpenAPI document")


def pointer(method: str, path: str, status: int) -> str:
    """JSON pointer of the documented JSON schema of that answer, inside the document."""
    for regex, template in _TEMPLATES:
        if regex.match(path) and method.lower() in _DOC["paths"][template]:
            escaped = template.replace("~", "~0").replace("/", "~1")
            return f"#/paths/{escaped}/{method.lower()}/responses/{status}/content/application~1json/schema"
    raise AssertionError(f"{method} {path} is not in the OpenAPI document")


def check_conforms(method: str, path: str, answer: Answer) -> None:
    """The answer is no 500, its status is documented for the operation, and a JSON body matches the
    documented schema of that status."""
    assert answer.status != 500, f"{method} {path}: 500 {answer.body[:300]!r}"
    responses = operation(method, path)["responses"]
    spec = responses.get(str(answer.status)) or responses.get("default")
    assert spec is not None, (
        f"{method} {path}: status {answer.status} is not documented ({sorted(responses)})"
    )
    schema = spec.get("content", {}).get("application/json", {}).get("schema")
    ctype = answer.headers.get(b"content-type", b"")
    if schema is None or not ctype.startswith(b"application/json"):
        return
    validator = jsonschema.Draft202012Validator(
        {"$ref": "urn:inferd" + pointer(method, path, answer.status)}, registry=_REGISTRY
    )
    errors = list(validator.iter_errors(json.loads(answer.body)))
    assert not errors, (
        f"{method} {path} {answer.status}: body {answer.body[:300]!r} breaks the schema: {errors[0]}"
    )
