"""Tenants' shares of LLM admission end to end: a real `inferd serve` with two tenants of equal weight and
a slow `sim-llm` that runs one sequence at a time behind a waiting room of 8. Tenant A floods (a bounded
number of requests from many threads); tenant B, sending requests one after another meanwhile, gets only
200s (its sequence takes the room of A's newest waiting one: A gets the 429s), and each of B's requests
is admitted ahead of A's backlog: few of A's requests finish between B's request and its answer, where
plain FIFO would make B wait for the whole backlog (9 answers of A)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from inferd.gateway.keys import key_digest, new_key
from tests.conftest import ServerProc, start_server

A, B = new_key(), new_key()
TENANTS = f"""
[tenants.a]
api_key_sha256 = ["{key_digest(A)}"]

[tenants.b]
api_key_sha256 = ["{key_digest(B)}"]
"""
MODEL = """builtin = "sim-llm"
workers = 1
[params]
step_base_ms = 20.0
[params.scheduler]
max_num_seqs = 1
max_waiting_seqs = 8
"""
"""One sequence at a time, 4 steps of about 20 ms each (prefill, then 3 decodes): about 12 requests/s."""

FLOOD_THREADS = 16
FLOOD_PER_THREAD = 12
B_REQUESTS = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("llm-fairness")
    (root / "repo" / "sim-llm").mkdir(parents=True)
    (root / "repo" / "sim-llm" / "model.toml").write_text(MODEL)
    (root / "inferd.toml").write_text(TENANTS)
    proc = start_server(root, "--model-repo", str(root / "repo"), "--config", str(root / "inferd.toml"))
    try:
        yield proc
    finally:
        proc.stop()


def complete(server: ServerProc, key: str, prompt: str) -> int:
    body = {"model": "sim-llm", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "seed": 1}
    req = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as err:
        err.read()
        return int(err.code)


def test_a_flood_neither_refuses_the_other_tenant_nor_queues_it_behind_the_backlog(
    server: ServerProc,
) -> None:
    a_status: Counter[int] = Counter()
    lock = threading.Lock()
    flooding = threading.Event()

    def flood(thread: int) -> None:
        for k in range(FLOOD_PER_THREAD):  # bounded: at most 192 requests in all
            status = complete(server, A, f"a {thread} {k}")
            with lock:
                a_status[status] += 1
                if a_status[429] >= 5:
                    flooding.set()
            time.sleep(0.1)

    def b_request(k: int) -> tuple[int, int]:
        """B's status, and how many of A's requests were answered 200 while B's was in flight."""
        with lock:
            before = a_status[200]
        status = complete(server, B, f"b {k}")
        with lock:
            return status, a_status[200] - before

    with ThreadPoolExecutor(FLOOD_THREADS) as pool:
        floods = [pool.submit(flood, t) for t in range(FLOOD_THREADS)]
        assert flooding.wait(30), f"A's flood never filled the waiting room: {dict(a_status)}"
        b = [b_request(k) for k in range(B_REQUESTS)]  # while A floods
        for f in floods:
            f.result()
    assert [s for s, _ in b] == [200] * B_REQUESTS, f"B was refused while within its share: {b}"
    assert max(n for _, n in b) <= 4, f"B waited behind A's backlog (A answers per B request): {b}"
    assert a_status[429] >= 5 and a_status[200] >= 5, dict(a_status)
    assert set(a_status) <= {200, 429}, dict(a_status)
