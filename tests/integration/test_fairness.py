"""Fairness between tenants end to end: a real `inferd serve` with two tenants of equal weight and a slow
`sim` with a small queue. Tenant A floods (a bounded number of requests from many threads); tenant B,
sending a few requests meanwhile, gets only 200s: the full queue makes room for B within its share by
refusing A's newest requests, and A gets the 429s."""

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
CONFIG = f"""
[tenants.a]
api_key_sha256 = ["{key_digest(A)}"]

[tenants.b]
api_key_sha256 = ["{key_digest(B)}"]

[models.sim]
max_batch_size = 4
max_queue_size = 8
max_wait_ms = 5.0

[models.sim.params]
base_ms = 150.0
per_item_ms = 0.0
"""
"""About 27 req/s: a batch of up to 4 every 150 ms on one worker, 8 items of queue (4 per tenant)."""

FLOOD_THREADS = 24
FLOOD_PER_THREAD = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("fairness")
    path = root / "inferd.toml"
    path.write_text(CONFIG)
    proc = start_server(root, "--model", "sim", "--config", str(path))
    try:
        yield proc
    finally:
        proc.stop()


def infer(server: ServerProc, key: str, text: str) -> int:
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    req = urllib.request.Request(
        f"{server.url}/v2/models/sim/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as err:
        err.read()
        return int(err.code)


def test_a_flooding_tenant_gets_the_429s_and_the_other_only_200s(server: ServerProc) -> None:
    a_status: Counter[int] = Counter()
    lock = threading.Lock()
    flooding = threading.Event()

    def flood(thread: int) -> None:
        for k in range(FLOOD_PER_THREAD):  # bounded: at most 288 requests in all
            status = infer(server, A, f"a-{thread}-{k}")
            with lock:
                a_status[status] += 1
                if a_status[429] >= 5:
                    flooding.set()
            time.sleep(0.01)

    with ThreadPoolExecutor(FLOOD_THREADS + 4) as pool:
        floods = [pool.submit(flood, t) for t in range(FLOOD_THREADS)]
        assert flooding.wait(30), f"A's flood never filled the queue: {dict(a_status)}"
        b_status = list(pool.map(lambda k: infer(server, B, f"b-{k}"), range(4)))  # while A floods
        b_status += [infer(server, B, f"b-late-{k}") for k in range(3)]
        for f in floods:
            f.result()
    assert b_status == [200] * 7, f"B was refused while within its share: {b_status}"
    assert a_status[429] >= 5 and a_status[200] >= 1, dict(a_status)
    assert set(a_status) <= {200, 429}, dict(a_status)
