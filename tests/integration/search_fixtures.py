"""A model repository for search tests: a hash embedder (8 dims, no weights) and a declared index."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

EMBEDDER = """
max_batch_size = 32
max_wait_ms = 2
inputs = [{ name = "TEXT", datatype = "BYTES" }]
outputs = [{ name = "EMBEDDING", datatype = "FP32", shape = [8] }, { name = "TOKENS", datatype = "INT32" }]
"""
INDEX = """
kind = "search"
[search]
shards = 2
replicas = {replicas}
embedder = "embedder"
dim = 8
fields = {{ lang = "keyword", year = "int" }}
"""


def model_repo(tmp: Path, replicas: int = 2) -> Path:
    repo = tmp / "models"
    (repo / "embedder" / "1").mkdir(parents=True)
    (repo / "embedder" / "model.toml").write_text(EMBEDDER)
    (repo / "embedder" / "1" / "model.py").write_text(
        "from tests.fakes.hash_embedder import HashEmbedder as Model  # noqa: F401\n"
    )
    (repo / "docs").mkdir()
    (repo / "docs" / "model.toml").write_text(INDEX.format(replicas=replicas))
    return repo


def call(url: str, method: str = "GET", body: Any = None, timeout_s: float = 30.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def doc(i: int, word: str = "", **fields: Any) -> dict[str, Any]:
    return {
        "id": f"d{i}",
        "title": f"title {i}",
        "text": f"document number{i} {word}".strip(),
        "fields": fields,
    }


def wait_serving(url: str, index: str, replicas: list[int], timeout_s: float = 60.0) -> dict[str, Any]:
    """Until every shard of the index has `replicas` serving replicas (they start one by one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = call(f"{url}/v1/indexes/{index}")
        if status == 200 and body["serving_replicas"] == replicas:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"index {index} not served by {replicas} replicas: {body}")
        time.sleep(0.05)
