"""The repository API's routes (api/repository.py) are in the OpenAPI document, and what they answer
matches it: the index's rows as the route encodes them, load's and unload's empty object, their errors."""

from __future__ import annotations

import json

import jsonschema
import msgspec
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from inferd.api.openapi import openapi_document
from inferd.fleet.repository_index import IndexRow, ModelState

DOC = openapi_document()
REGISTRY = Registry().with_resource("urn:inferd", DRAFT202012.create_resource(DOC))


def errors(path: str, status: int, body: bytes) -> list[str]:
    escaped = path.replace("~", "~0").replace("/", "~1")
    ref = f"urn:inferd#/paths/{escaped}/post/responses/{status}/content/application~1json/schema"
    validator = jsonschema.Draft202012Validator({"$ref": ref}, registry=REGISTRY)
    return [e.message for e in validator.iter_errors(json.loads(body))]


def test_the_index_load_and_unload_are_documented_with_their_answers() -> None:
    paths = DOC["paths"]
    index, load, unload = (paths[p]["post"] for p in (
        "/v2/repository/index", "/v2/repository/models/{model}/load", "/v2/repository/models/{model}/unload"
    ))
    assert not index["requestBody"]["required"] and not load["requestBody"]["required"]  # tritonclient sends none
    assert {"200", "400", "401", "403", "404", "409", "503"} <= set(load["responses"])
    assert set(unload["responses"]) == set(load["responses"])
    rows = [IndexRow("sim", "1", ModelState.READY), IndexRow("slow", "", ModelState.UNAVAILABLE, "unloaded")]
    assert errors("/v2/repository/index", 200, msgspec.json.encode(rows)) == []  # as the route encodes them
    assert errors("/v2/repository/index", 200, b'[{"name": "sim", "version": "1", "state": "GONE"}]') != []
    assert errors("/v2/repository/models/{model}/load", 200, b"{}") == []
    assert errors("/v2/repository/models/{model}/unload", 404, b'{"error": "unknown model", "request_id": null}') == []
