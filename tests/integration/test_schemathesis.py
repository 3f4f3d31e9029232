"""Schemathesis against a real `inferd serve` (sim, sim-llm and minilm, one worker each): requests generated
from the served /openapi.json never get a 5xx other than 503/504, and every answer's status and body match
the document (checks not_a_server_error, status_code_conformance, response_schema_conformance). The
document is fetched from the server; only its model names are pinned to the served ones per route (and
generation lengths kept short), so the requests reach the models instead of 404s."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from tests.conftest import ServerProc, start_server

MODELS = ("sim", "sim-llm", "minilm")
ROUTE_MODELS = {"infer": ["sim", "minilm"], "text": ["sim-llm"], "embeddings": ["minilm"]}
"""The model names generated for each kind of route (other names are fuzzed in-process, tests/fuzz)."""
EXAMPLES = int(os.environ.get("INFERD_SCHEMATHESIS_EXAMPLES", "80"))
"""Examples per API operation (19 operations); the default keeps the whole test well under 90 s."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120 + EXAMPLES)]
TIMEOUT_HEADER = {"X-Request-Timeout-Ms": "1500"}
"""Every generated request carries a deadline, so a long generation ends in a documented 504."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("schemathesis")
    s = start_server(tmp, *(a for m in MODELS for a in ("--model", m)), "--data-dir", str(tmp / "data"))
    yield s
    s.stop()


def pinned(doc: dict[str, Any]) -> dict[str, Any]:
    """The served document with model names (path and body) limited to the served models, the version to
    1, OIP inputs to the sim model's one, and generation lengths short."""
    doc = json.loads(json.dumps(doc))
    repository = "/v2/repository/models/"  # load and unload stop and start workers: not for a fuzzer (the index is)
    doc["paths"] = {path: item for path, item in doc["paths"].items() if not path.startswith(repository)}
    for path, item in doc["paths"].items():
        if path.startswith("/v1/indexes"):  # creating indexes starts worker processes: not for a fuzzer
            item.pop("put", None)
            for op in item.values():
                for param in op.get("parameters", []):
                    if param["name"] == "name":
                        param["schema"] = {"type": "string", "enum": ["absent"]}
    for path, item in doc["paths"].items():
        for op in item.values():
            for param in op.get("parameters", []):
                if param["name"] == "model":
                    names = ROUTE_MODELS["infer"] if path.endswith("/infer") else list(MODELS)
                    param["schema"] = {"type": "string", "enum": names}
                elif param["name"] == "version":
                    param["schema"] = {"type": "string", "enum": ["1"]}
    schemas = doc["components"]["schemas"]
    schemas["EmbeddingsRequest"]["properties"]["model"] = {"enum": ROUTE_MODELS["embeddings"]}
    for name in ("CompletionRequest", "ChatRequest"):
        schemas[name]["properties"]["model"] = {"enum": ROUTE_MODELS["text"]}
    for name in ("CompletionRequest", "ChatRequest"):
        props = schemas[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):  # sim-llm answers 24 tokens in well under 1 s
            if field in props:
                props[field] = {"type": "integer", "minimum": 1, "maximum": 24}
        schemas[name]["required"] = [*schemas[name]["required"], "max_tokens"]
        props["n"] = {"type": "integer", "minimum": 0, "maximum": 3}
    inp = schemas["RequestInput"]["properties"]
    inp["name"] = {"type": "string", "enum": ["INPUT0", "TEXT"]}
    inp["datatype"] = {"type": "string", "enum": ["BYTES"]}
    inp["shape"] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "maxItems": 2}
    return doc


@pytest.fixture(scope="module")
def api_schema(server: ServerProc) -> Any:
    with urllib.request.urlopen(f"{server.url}/openapi.json", timeout=10) as r:
        doc = json.load(r)
    config = SchemathesisConfig.from_dict(
        {"checks": {"not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "503", "504"]}}}
    )
    schema = schemathesis.openapi.from_dict(pinned(doc), config=config)
    schema.config.update(base_url=server.url)
    return schema


def test_generated_requests_get_documented_answers(api_schema: Any) -> None:
    """Each API operation in turn, EXAMPLES generated requests each (the schemathesis pytest plugin's lazy
    fixture loader does not run under this pytest, so the operations' hypothesis strategies are used as is)."""
    failures = []
    for result in api_schema.get_all_operations():
        operation = result.ok()

        cases = st.one_of(
            operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)
        )

        @given(case=cases)
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def exchange(case: Any) -> None:
            case.call_and_validate(
                headers=TIMEOUT_HEADER,
                timeout=10,
                checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
            )

        try:
            exchange()
        except (Exception, BaseExceptionGroup) as exc:  # every operation is tried; failures reported together
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
