"""Tenants' quotas end to end: two `inferd serve` front ends share one redis-server (tests/redis_server.py),
so a tenant's requests, tokens and concurrency are counted once across both. Refusals are 429s with
Retry-After and OpenAI's x-ratelimit-* headers; an unlimited tenant is untouched."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from inferd.gateway.keys import key_digest, new_key
from tests.conftest import ServerProc, start_server
from tests.redis_server import RedisServer

ACME, TOK, FREE = new_key(), new_key(), new_key()
CONTEXT = 2048
"""sim-llm's context length: tokens_per_min may not be lower (the longest request it accepts)."""


def config(redis_url: str) -> str:
    return f"""
[gateway]
redis_url = "{redis_url}"

[tenants.acme]
api_key_sha256 = ["{key_digest(ACME)}"]
requests_per_s = 0.01
burst = 3

[tenants.tok]
api_key_sha256 = ["{key_digest(TOK)}"]
tokens_per_min = {CONTEXT}
max_concurrency = 1

[tenants.free]
api_key_sha256 = ["{key_digest(FREE)}"]
"""


@pytest.fixture(scope="module")
def front_ends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, ServerProc]]:
    root = tmp_path_factory.mktemp("quotas")
    redis = RedisServer()
    redis.start()
    path = root / "inferd.toml"
    path.write_text(config(redis.url))
    servers: list[ServerProc] = []
    try:
        for _ in range(2):
            servers.append(start_server(root, "--model", "sim", "--model", "sim-llm", "--config", str(path)))
        yield servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()
        redis.stop()


def post(server: ServerProc, path: str, key: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(
        f"{server.url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            status, headers, out = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        status, headers, out = err.code, dict(err.headers), err.read()
    return status, {k.lower(): v for k, v in headers.items()}, json.loads(out)


def infer(server: ServerProc, key: str) -> tuple[int, dict[str, str], Any]:
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["q"]}]}
    return post(server, "/v2/models/sim/infer", key, body)


def chat(server: ServerProc, key: str, max_tokens: int) -> tuple[int, dict[str, str], Any]:
    body = {"model": "sim-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return post(server, "/v1/chat/completions", key, body)


def test_a_tenants_request_rate_is_counted_once_across_front_ends(
    front_ends: tuple[ServerProc, ServerProc],
) -> None:
    a, b = front_ends
    remaining = []
    for server in (a, b, a):  # burst 3, then one request per 100 s
        status, headers, _ = infer(server, ACME)
        assert status == 200
        assert headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(headers["x-ratelimit-remaining-requests"]))
    assert remaining == [2, 1, 0], "both front ends draw on one bucket in Redis"
    status, headers, body = infer(b, ACME)
    assert status == 429, body
    assert "acme" in body["error"] and "requests" in body["error"]
    assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    status, headers, _ = infer(b, FREE)  # another tenant, unlimited, is untouched
    assert status == 200 and not any(h.startswith("x-ratelimit") for h in headers)


def test_tokens_are_reserved_then_refunded_and_concurrency_is_capped(
    front_ends: tuple[ServerProc, ServerProc],
) -> None:
    a, b = front_ends
    status, headers, body = chat(a, TOK, max_tokens=8)
    assert status == 200, body
    prompt = body["usage"]["prompt_tokens"]
    assert headers["x-ratelimit-limit-tokens"] == str(CONTEXT)
    assert int(headers["x-ratelimit-remaining-tokens"]) == CONTEXT - prompt - 8, (
        "prompt + max_tokens reserved"
    )
    # The longest request the context allows no longer fits what the first one used in this minute.
    status, headers, body = chat(b, TOK, max_tokens=CONTEXT - prompt - 1)
    assert status == 429, body
    assert "tokens" in body["error"]["message"] and int(headers["retry-after"]) >= 1
    # One stream in flight holds the tenant's only slot, on either front end, until it closes.
    conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=20)
    stream = {"model": "sim-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps({**stream, "stream": True}),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOK}"},
    )
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    status, headers, body = chat(b, TOK, max_tokens=4)
    assert status == 429 and "concurrency" in body["error"]["message"], body
    assert headers["retry-after"] == "1"
    conn.close()  # the client leaves: the stream ends and its slot is freed
    deadline = time.monotonic() + 15
    while (status := chat(b, TOK, max_tokens=4)[0]) == 429 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status == 200, "the slot came back once the stream closed"
