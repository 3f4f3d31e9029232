"""The warm-up gate with real workers, for each kind: a worker whose warm-up takes 2 s gets no request before
its warm-up ends, and the requests sent meanwhile are answered by the model's other worker (or wait until
the front end takes the new one in).

One `inferd serve` holds a batch model (sim: `params.warmup_ms`), an LLM (sim-llm: `params.warmup_ms`) and
a search index (its replicas' warm-up through the INFERD_SEARCH_WARMUP_MS hook), each with one worker
warm and serving. A second worker then joins (a scale-up; for the index, a replica killed and replaced),
and requests go on while it warms up. What is asserted is the order of recorded events, never a time
window: the worker's own log line that its warm-up ended (written before it tells the front end,
worker/device.py, kinds/search/replica.py), the front end's log line and view of when it took the worker in,
which worker answered each request (sim's execution log, sim-llm's x-inferd-worker header), and when the
test sent each request.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from inferd.kinds.llm.sim_llm import sim_llm_tokens
from inferd.kinds.search.warmup import HOOK
from inferd.models.sim import sim_digest
from tests.checked_load import wait_for
from tests.conftest import ServerProc, start_server
from tests.integration.search_fixtures import call

WARMUP_MS = 2000
BATCH = """
workers = 1
max_batch_size = 8
max_wait_ms = 2
inputs = [{{ name = "INPUT0", datatype = "BYTES" }}]
outputs = [{{ name = "OUTPUT0", datatype = "BYTES" }}]
[params]
base_ms = 5
per_item_ms = 0.0
warmup_ms = {warmup_ms}
exec_log = "{exec_log}"
"""
LLM = f"""
builtin = "sim-llm"
workers = 1
[params]
step_base_ms = 2
warmup_ms = {WARMUP_MS}
"""
INDEX = """
kind = "search"
[search]
shards = 1
replicas = 2
embedder = "none"
"""
LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class Fleet:
    server: ServerProc
    exec_log: Path

    def lines(self, pattern: str) -> list[tuple[float, re.Match[str]]]:
        """Log lines (the server's and its workers') matching `pattern`, with their wall-clock time."""
        found = []
        for line in self.server.log().splitlines():
            stamp, match = LOG_TIME.match(line), re.search(pattern, line)
            if stamp and match:
                found.append((datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), match))
        return found

    def runs(self) -> list[tuple[int, float, str]]:
        """Every input sim ran, warm-ups included: (pid, wall time the batch started, input)."""
        rows = [line.split(" ", 2) for line in self.exec_log.read_text().splitlines()]
        return [(int(r[0]), float(r[1]), r[2]) for r in rows if len(r) == 3]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("warmup")
    exec_log = root / "executions.log"
    exec_log.touch()
    repo = root / "repo"
    models = {"warm": BATCH.format(warmup_ms=WARMUP_MS, exec_log=exec_log), "warm-llm": LLM, "docs": INDEX}
    for name, toml in models.items():
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    (repo / "warm" / "1").mkdir()
    (repo / "warm" / "1" / "model.py").write_text(
        "from tests.counting_sim import CountingSim as Model  # noqa: F401\n"
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv(HOOK, str(WARMUP_MS))  # the replicas' warm-up (the server's workers inherit it)
        server = start_server(root, "--model-repo", str(repo), "--no-grpc")
    yield Fleet(server, exec_log)
    assert server.stop() in (0, -15)


def warm_up_ended(fleet: Fleet, pattern: str, after: float) -> tuple[float, str] | None:
    """When a worker logged (after `after`) that its warm-up ended, and its id; its warm-up took the 2 s."""
    done = [(t, m) for t, m in fleet.lines(pattern) if t >= after]
    if not done:
        return None
    at, line = done[0]
    assert float(line.group(2)) >= WARMUP_MS / 1000, line.group(0)
    return at, line.group(1)


def admin(server: ServerProc, path: str, method: str = "GET") -> Any:
    req = urllib.request.Request(f"{server.admin_url}{path}", method=method)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def post(url: str, body: Any) -> tuple[Any, str]:
    """The answer to a JSON POST, and the worker that answered (x-inferd-worker, where the API says it)."""
    headers = {"content-type": "application/json"}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read()), r.headers.get("x-inferd-worker", "")


def ready_workers(server: ServerProc, model: str) -> set[str]:
    return {
        w["worker_id"]
        for w in admin(server, "/admin/workers")["workers"]
        if w["model"] == model and w["state"] == "ready"
    }


@dataclass
class Poll:
    """One look at the front end's view, and when it was taken (between `sent` and `returned`)."""

    sent: float
    returned: float
    admitted: set[str]
    """The workers it sends requests to (batch, LLM: ready; search: replicas serving)."""


@dataclass
class Sent:
    at: float
    worker: str
    """Who answered, where the answer says it (sim-llm's x-inferd-worker)."""
    key: str
    done: float = 0.0
    """When its answer came back."""


def run_until(
    fleet: Fleet,
    send: Callable[[int], Sent],
    look: Callable[[], set[str]],
    warmed: Callable[[], tuple[float, str] | None],
    served_by_new: Callable[[str, list[Sent]], bool],
) -> tuple[float, str, list[Sent], list[Poll]]:
    """Requests one at a time, each followed by a look at the front end's view, until the new worker's warm-up
    has ended (`warmed`: when, and its id) and then until it answered a request itself (bursts of 8 at once:
    a lone request may always find the old worker idle). Returns the warm-up's end, the new worker, what was
    sent and what was seen."""
    sent: list[Sent] = []
    polls: list[Poll] = []
    deadline = time.monotonic() + 30

    def timed(i: int) -> Sent:
        request = send(i)
        request.done = time.time()
        return request

    i = 0
    while (end := warmed()) is None:
        assert time.monotonic() < deadline, "the new worker never finished its warm-up"
        sent.append(timed(i))
        t0 = time.time()
        admitted = look()
        polls.append(Poll(t0, time.time(), admitted))
        i += 1
    warm_end, new = end
    with ThreadPoolExecutor(8) as pool:
        while not served_by_new(new, sent):
            assert time.monotonic() < deadline, f"the new worker {new} never got a request once warm"
            sent.extend(pool.map(timed, range(i, i + 8)))
            i += 8
    return warm_end, new, sent, polls


def check_gate(
    warm_end: float,
    took_in: float,
    new: str,
    sent: list[Sent],
    polls: list[Poll],
    answered_by_new: Callable[[Sent], bool],
) -> None:
    """`warm_end`: the new worker's log line that its warm-up ended; `took_in`: the front end's that it took
    the worker in."""
    assert took_in >= warm_end, "the front end took the worker in before its warm-up ended"
    seen_before = [p for p in polls if p.returned < warm_end]
    assert seen_before and not [p for p in seen_before if new in p.admitted], (
        "admitted before its warm-up ended"
    )
    meanwhile = [s for s in sent if s.at < warm_end]
    assert meanwhile, "no request was sent while the new worker warmed up"
    # each was answered with its own answer (`send` checks it): by the other worker, or by the new one only
    # once the front end had taken it in (it waited)
    assert any(not answered_by_new(s) for s in meanwhile)
    assert all(s.done >= took_in for s in meanwhile if answered_by_new(s))
    assert any(answered_by_new(s) for s in sent), "the new worker never answered"


def test_a_batch_worker_gets_no_request_before_its_warm_up_ends(fleet: Fleet) -> None:
    server = fleet.server
    old = ready_workers(server, "warm")
    (old_pid,) = {pid for pid, _, item in fleet.runs() if item == "warmup"}
    started = time.time()
    admin(server, "/admin/models/warm/scale?workers=2", "POST")

    def send(i: int) -> Sent:
        at, key = time.time(), f"b{i}"
        body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [key]}]}
        answer, _ = post(f"{server.url}/v2/models/warm/infer", body)
        assert answer["outputs"][0]["data"] == [sim_digest("warm", 1, key)]
        return Sent(at, "", key)

    def warmed() -> tuple[float, str] | None:
        return warm_up_ended(fleet, r"worker (\S+) ready: model warm v\d+ .* warm-up (\S+)s", started)

    def pid_of(key: str) -> int | None:
        return next((pid for pid, _, item in fleet.runs() if item == key), None)

    def by_new(new: str, sent: list[Sent]) -> bool:
        return any(pid_of(s.key) not in (old_pid, None) for s in sent)

    warm_end, new, sent, polls = run_until(fleet, send, lambda: ready_workers(server, "warm"), warmed, by_new)
    assert new not in old
    (new_pid,) = {pid for pid, _, item in fleet.runs() if item == "warmup"} - {old_pid}
    (took_in, _), *_ = fleet.lines(rf"worker {re.escape(new)} \(pid \d+\) of model warm v\d+ is ready")
    check_gate(warm_end, took_in, new, sent, polls, lambda s: pid_of(s.key) == new_pid)
    # its own record: the warm-up ran first; the first request after it ended (times to the ms)
    runs = [(at, item) for pid, at, item in fleet.runs() if pid == new_pid]
    assert runs[0][1] == "warmup" and all(at + 0.001 >= warm_end for at, _ in runs[1:])


def test_an_llm_worker_gets_no_sequence_before_its_warm_up_ends(fleet: Fleet) -> None:
    server = fleet.server
    old = ready_workers(server, "warm-llm")
    started = time.time()
    admin(server, "/admin/models/warm-llm/scale?workers=2", "POST")

    def send(i: int) -> Sent:
        at, prompt = time.time(), f"prompt number {i}"
        body = {"model": "warm-llm", "prompt": prompt, "max_tokens": 3, "seed": 1}
        answer, worker = post(f"{server.url}/v1/completions", body)
        assert answer["choices"][0]["text"] == " ".join(sim_llm_tokens(prompt, 1, 3))
        return Sent(at, worker, prompt)

    def warmed() -> tuple[float, str] | None:
        return warm_up_ended(fleet, r"worker (\S+) ready: model warm-llm v\d+ .* warm-up (\S+)s", started)

    def by_new(new: str, sent: list[Sent]) -> bool:
        return any(s.worker == new for s in sent)

    warm_end, new, sent, polls = run_until(
        fleet, send, lambda: ready_workers(server, "warm-llm"), warmed, by_new
    )
    assert new not in old
    (took_in, _), *_ = fleet.lines(rf"LLM worker {re.escape(new)} \(pid \d+\) of model warm-llm is ready")
    check_gate(warm_end, took_in, new, sent, polls, lambda s: s.worker == new)


def test_a_search_replica_gets_no_query_before_its_warm_up_ends(fleet: Fleet) -> None:
    server = fleet.server
    status, _ = call(
        f"{server.url}/v1/indexes/docs/documents", "POST", {"documents": [{"id": "a", "text": "alpha beta"}]}
    )
    assert status in (200, 201, 202), status

    def serving() -> set[str]:
        _, body = call(f"{server.url}/v1/indexes/docs")
        return {r["worker"] for shard in body["workers"] for r in shard if r["phase"] == "serving"}

    wait_for(lambda: len(serving()) == 2, 30, "both replicas serving")
    victim, survivor = sorted(serving())
    started = time.time()
    admin(server, f"/admin/workers/{victim}/restart?force=true", "POST")
    wait_for(lambda: victim not in serving(), 10, "the killed replica out of service")

    def send(i: int) -> Sent:
        at = time.time()
        status, body = call(
            f"{server.url}/v1/indexes/docs/search", "POST", {"query": "alpha", "k": 5, "cache": False}
        )
        assert status == 200 and body["coverage"] == {"shards": 1, "answered": 1}, body
        assert [h["id"] for h in body["hits"]] == ["a"]
        return Sent(at, "", "alpha")

    def warmed() -> tuple[float, str] | None:
        return warm_up_ended(fleet, r"replica (\S+) serves shard 0, .* warm-up (\S+)s", started)

    def by_new(new: str, sent: list[Sent]) -> bool:  # (which replica answers a search is not told)
        return new in serving()

    warm_end, new, sent, polls = run_until(fleet, send, serving, warmed, by_new)
    assert new not in (victim, survivor)
    assert [s for s in sent if s.at < warm_end], "no search was sent while the new replica warmed up"
    seen_before = [p for p in polls if p.returned < warm_end]
    # until its warm-up ended, the front end read only from the other replica: it answered every search
    assert seen_before and all(p.admitted == {survivor} for p in seen_before), seen_before
