"""`inferd serve --frontends 2` with a failing canary: the rollback is one decision for the server.

Every unversioned request goes to the canary (weight 1.0), whose every answer fails. Through one kept
connection to each front end, 8 failures each: under `min_requests` = 12 for either front end alone,
over it summed. The owner judges the sum, and both front ends stop sending canary traffic: their
weights go to 0 and their unversioned requests are answered by version 1.

A stepping canary goes on from its step when the owner (the lease holder, the judge) is SIGKILLed and
started again: the new owner takes the state the server shares, never its config's first step.

Bounded: one server, a few dozen requests."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator

import pytest

from inferd.models.sim import sim_digest
from tests.checked_load import wait_for
from tests.conftest import ServerProc, alive, child_pids, start_server
from tests.frontends_harness import scrape
from tests.integration.test_traffic import COMMON, write_repo

FAILING = (
    COMMON
    + '[versions.2.params]\nfail_prefix = "x"\n\n'
    + "[traffic]\ncanary = { version = 2, weight = 1.0 }\n"
    + "rollback = { max_error_ratio = 0.5, short_window_s = 30, long_window_s = 60, min_requests = 12 }\n"
)
STEPPING = COMMON + "[versions.2]\n\n[traffic]\ncanary = { version = 2, steps = [0.25, 0.75], step_interval_s = 4 }\n"
"""Steps to 0.75 after 4 s and stays there: an owner started again from its config would send 0.25."""
EACH = 8
"""Failed canary calls through each front end: under min_requests alone, over it summed."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("frontends-canary")
    s = start_server(root, "--model-repo", str(write_repo(root, {"failing": FAILING, "stepping": STEPPING})), "--frontends", "2")
    yield s
    assert s.stop() in (0, -15)


def requests_of(sample: dict[str, float], frontend: int) -> float:
    return sum(
        v
        for k, v in sample.items()
        if k.startswith("inferd_requests_total{") and f'frontend="{frontend}"' in k and 'model="failing"' in k
    )


def infer(conn: http.client.HTTPConnection, text: str, path: str = "") -> tuple[int, str | None]:
    """(status, the version that answered or the error) of one request on a kept connection; a 200's
    output is checked."""
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    conn.request(
        "POST", f"/v2/models/failing{path}/infer", json.dumps(body), {"Content-Type": "application/json"}
    )
    r = conn.getresponse()
    answer = json.loads(r.read())
    if r.status != 200:
        return r.status, answer["error"]
    version = answer["model_version"]
    assert answer["outputs"][0]["data"] == [sim_digest("failing", int(version), text)]
    return r.status, version


def infer_patiently(conn: http.client.HTTPConnection, text: str, path: str = "") -> tuple[int, str | None]:
    """`infer`, again after Retry-After when a front end refused it as saturated (a loaded test box:
    each /metrics scrape merges both front ends' texts on one of them)."""
    for _ in range(5):
        status, version = infer(conn, text, path)
        if status != 429 or "saturated" not in str(version):
            return status, version
        time.sleep(1.0)
    return status, version


def frontend_of(server: ServerProc, conn: http.client.HTTPConnection, n: int) -> int:
    """Which front end a kept connection reached: the one whose count grew by one pinned request."""
    before = scrape(server)
    assert infer_patiently(conn, f"probe-{n}", "/versions/1") == (200, "1")
    after = scrape(server)
    (grew,) = [i for i in (0, 1) if requests_of(after, i) > requests_of(before, i)]
    return grew


def one_connection_per_front_end(server: ServerProc) -> dict[int, http.client.HTTPConnection]:
    kept: dict[int, http.client.HTTPConnection] = {}
    for n in range(40):  # the kernel spreads new connections over the two listeners
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        index = frontend_of(server, conn, n)
        if index in kept:
            conn.close()
        else:
            kept[index] = conn
        if len(kept) == 2:
            return kept
        time.sleep(0.05)  # a front end listens once its workers are ready
    raise AssertionError(f"no connection reached both front ends in 40 tries: {sorted(kept)}")


def canary_weights(server: ServerProc, model: str = "failing") -> dict[int, float | None]:
    sample = scrape(server)
    return {i: sample.get(f'inferd_traffic_weight{{frontend="{i}",model="{model}",version="2"}}') for i in (0, 1)}


def test_canary_errors_split_over_two_front_ends_roll_back_the_canary_on_both(server: ServerProc) -> None:
    conns = one_connection_per_front_end(server)
    try:
        assert canary_weights(server) == {0: 1.0, 1: 1.0}
        for index, conn in conns.items():
            answers = [infer_patiently(conn, f"x-{index}-{i}") for i in range(EACH)]
            assert {status for status, _ in answers} == {422}, answers  # v2 fails every input
        for _ in range(30):  # a scrape merges both front ends' texts: polled slowly, not to load them
            if canary_weights(server) == {0: 0.0, 1: 0.0}:
                break
            time.sleep(0.5)
        assert canary_weights(server) == {0: 0.0, 1: 0.0}, server.log()
        for index, conn in conns.items():
            answers = [infer_patiently(conn, f"x-after-{index}-{i}") for i in range(20)]
            assert set(answers) == {(200, "1")}, (index, answers)
    finally:
        for conn in conns.values():
            conn.close()
    sample = scrape(server)
    rollbacks = [
        sample.get(f'inferd_traffic_rollbacks_total{{frontend="{i}",model="failing"}}', 0.0) for i in (0, 1)
    ]
    assert rollbacks == [1.0, 0.0]  # judged once, by the owner, on both front ends' outcomes
    with urllib.request.urlopen(f"{server.admin_url}/admin/traffic", timeout=10) as r:
        traffic = json.loads(r.read())
    (split,) = [s for s in traffic["splits"] if s["model"] == "failing"]
    assert split["state"] == "rolled_back"
    (event,) = [e for e in traffic["history"] if e["model"] == "failing"]
    assert f"short window, {2 * EACH} requests" in event["reason"], event  # the sum of both front ends' calls
    assert "rolled back to weight 0" in server.log()


def test_an_owner_started_again_goes_on_from_the_canary_step_the_server_had(server: ServerProc) -> None:
    wait_for(lambda: canary_weights(server, "stepping") == {0: 0.75, 1: 0.75}, 60, "step 1 on both front ends")
    workers = worker_processes(server)
    (owner,) = [p for p in child_pids(server.proc.pid) if alive(p) and set(child_pids(p)) & workers]
    judges = server.log().count("it judges the canaries")
    os.kill(owner, signal.SIGKILL)
    wait_for(lambda: server.log().count("it judges the canaries") > judges, 60, "a new owner judging")
    with urllib.request.urlopen(f"{server.admin_url}/admin/traffic", timeout=10) as r:
        traffic = json.loads(r.read())
    (split,) = [s for s in traffic["splits"] if s["model"] == "stepping"]
    assert (split["step"], split["state"]) == (1, "active"), split  # 0 would be its config's first step
    assert canary_weights(server, "stepping")[1] == 0.75  # the other front end never went back either


def worker_processes(server: ServerProc) -> set[int]:
    """The server's worker processes: its descendants that run inferd.worker.main."""
    found, todo = set(), [server.proc.pid]
    while todo:
        for pid in child_pids(todo.pop()):
            todo.append(pid)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"inferd.worker.main" in f.read() and alive(pid):
                        found.add(pid)
            except OSError:
                pass
    return found
