"""`inferd serve --frontends 2` serving a search index (2 shards x 2 replicas, the replicas join both
front ends; front end 0 is the one writer of the shards' logs):

* writes land on both front ends (new connections: SO_REUSEPORT picks) and every one is acknowledged;
  the follower's are forwarded to the owner; searches through either front end then find every
  document (with the writes' seqs as min_seq: the guarantee across front ends, docs/search.md);
* an index created through the API is served by both front ends, and gone from both once deleted;
* a follower answers a bad write's 400 itself: the owner's count of forwarded writes does not move;
* with the owner hung (SIGSTOPped), a follower's write gets 503 naming it within seconds (the owner
  answers no ping), not after the forward's 150 s, while its searches and gets go on;
* with the owner down (SIGKILLed while the parent is stopped, so that it stays down), a write gets 503
  with Retry-After naming the owner (or the store the stopped parent runs, once the follower's last word
  from it ran out), while searches and gets go on from the replicas; once the parent
  restarts the owner, writes are taken again and found on both front ends.

Bounded: one server, a few dozen requests, every wait capped."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message

import pytest

from tests.checked_load import wait_for
from tests.conftest import ServerProc, alive, child_pids, start_server
from tests.frontends_harness import scrape
from tests.integration.search_fixtures import call, doc, model_repo

DOCS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("search-frontends")
    repo = str(model_repo(tmp))
    s = start_server(tmp, "--model-repo", repo, "--data-dir", str(tmp / "data"), "--frontends", "2")
    try:
        wait_for(lambda: both_up(s), 60, "both front ends up")
        yield s
    finally:
        s.stop()


def both_up(server: ServerProc) -> bool:
    sample = scrape(server)
    return all(sample.get(f'inferd_frontend_up{{frontend="{i}"}}') == 1.0 for i in (0, 1))


def docs_ok(sample: dict[str, float], frontend: str) -> float:
    """Requests for index docs answered ok by one front end."""
    return sum(
        v
        for k, v in sample.items()
        if k.startswith("inferd_requests_total{")
        and f'frontend="{frontend}"' in k
        and 'model="docs"' in k
        and 'outcome="ok"' in k
    )


def search_ids(server: ServerProc, query: str, **extra: object) -> set[str]:
    status, body = call(
        f"{server.url}/v1/indexes/docs/search", "POST", {"query": query, "mode": "lexical", "k": 50, **extra}
    )
    assert status == 200, body
    return {h["id"] for h in body["hits"]}


def write(server: ServerProc, i: int, word: str) -> tuple[int, dict, Message]:
    """(status, body, headers) of one upsert, on a new connection."""
    data = json.dumps({"documents": [doc(i, word)]}).encode()
    req = urllib.request.Request(
        f"{server.url}/v1/indexes/docs/documents", data, {"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def owner_pid(server: ServerProc) -> int:
    (owner,) = [p for p in child_pids(server.proc.pid) if alive(p) and child_pids(p)]  # it runs the workers
    return owner


def forwarded(sample: dict[str, float]) -> float:
    """The search writes forwarded to the owner (front end 0), whatever their outcome."""
    name = "inferd_search_forwarded_writes_total{"
    return sum(v for k, v in sample.items() if k.startswith(name) and 'frontend="0"' in k)


def send(
    conn: http.client.HTTPConnection, method: str, path: str, body: object = None
) -> tuple[int, dict, Message]:
    """(status, body, headers) of one request on a kept-alive connection (`body`: JSON, or raw bytes)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"content-type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read() or b"null"), r.headers


def connection_to(server: ServerProc, frontend: str) -> http.client.HTTPConnection:
    """A kept-alive connection that front end `frontend` took (SO_REUSEPORT picks): the one whose get
    that front end counted."""
    for _ in range(30):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        before = docs_ok(scrape(server), frontend)
        assert send(conn, "GET", "/v1/indexes/docs/documents/d1")[0] == 200
        if docs_ok(scrape(server), frontend) > before:
            return conn
        conn.close()
    raise AssertionError(f"no connection of 30 went to front end {frontend}")


def follower_answers(server: ServerProc, answers: list) -> bool:
    """One write's answer; False when the connection was reset (the kernel resets a connection it
    handed the dying owner's listener at the moment it closed)."""
    try:
        answers.append(write(server, 100, "beta"))
    except ConnectionResetError:
        return False
    return True


def test_writes_through_both_front_ends_are_found_by_searches_on_both(server: ServerProc) -> None:
    before = scrape(server)
    seqs = []
    for i in range(DOCS):
        status, body, _ = write(server, i, "alpha")
        assert status == 200, body
        seqs.append(body["seq"])
    after = scrape(server)
    took = {fe: docs_ok(after, fe) - docs_ok(before, fe) for fe in ("0", "1")}
    assert sum(took.values()) == DOCS
    assert took["0"] > 0 and took["1"] > 0, f"writes did not land on both front ends: {took}"
    latest = [max(s[shard] for s in seqs) for shard in range(2)]
    for i in range(DOCS):  # each on a new connection: either front end answers
        assert f"d{i}" in search_ids(server, f"number{i}", min_seq=latest)
    for _ in range(6):
        assert search_ids(server, "alpha", min_seq=latest) == {f"d{i}" for i in range(DOCS)}
    status, body = call(f"{server.url}/v1/indexes/docs/documents/d3")
    assert status == 200 and body["id"] == "d3"
    read = {fe: docs_ok(scrape(server), fe) - docs_ok(after, fe) for fe in ("0", "1")}
    assert read["0"] > 0 and read["1"] > 0, f"the reads did not land on both front ends: {read}"


def test_an_index_created_and_deleted_through_either_front_end_is_so_on_both(server: ServerProc) -> None:
    url = f"{server.url}/v1/indexes/notes"
    settings = {"shards": 1, "replicas": 1, "embedder": "none"}
    status, body = call(url, "PUT", settings)
    assert status == 201, body
    for _ in range(6):  # either front end: it exists with these settings
        status, body = call(url, "PUT", settings)
        assert status == 200 and body["name"] == "notes", body
    status, body = call(f"{url}/documents", "POST", {"documents": [doc(1, "delta")]})
    assert status == 200, body
    for _ in range(6):
        status, found = call(f"{url}/search", "POST", {"query": "delta", "min_seq": body["seq"]})
        assert status == 200 and [h["id"] for h in found["hits"]] == ["d1"], found
    status, body = call(url, "DELETE")
    assert status == 200 and body == {"deleted": "notes"}, body
    wait_for(lambda: all(call(url)[0] == 404 for _ in range(6)), 10, "the index gone from both front ends")


def test_a_followers_bad_write_is_its_own_400_and_never_reaches_the_owner(server: ServerProc) -> None:
    conn = connection_to(server, "1")
    try:
        before = forwarded(scrape(server))
        bad = b'{"documents": [{"id": "x", "text": 5}]}'
        status, body, _ = send(conn, "POST", "/v1/indexes/docs/documents", bad)
        assert status == 400 and "text and title must be strings" in body["error"], body
        status, body, _ = send(conn, "PUT", "/v1/indexes/other", {"shards": 0, "embedder": "none"})
        assert status == 400 and "shards" in body["error"], body
        assert forwarded(scrape(server)) == before
        good = {"documents": [doc(300, "zeta")]}
        answers = [send(conn, "POST", "/v1/indexes/docs/documents", good)]
        while answers[-1][0] == 503 and len(answers) < 20:  # the owner refused to embed it (saturated)
            time.sleep(0.5)
            answers.append(send(conn, "POST", "/v1/indexes/docs/documents", good))
        assert answers[-1][0] == 200, answers[-1][1]
        assert forwarded(scrape(server)) == before + len(answers)  # a good one is forwarded, and counted
    finally:
        conn.close()


def test_with_the_owner_hung_a_write_gets_503_within_seconds_and_reads_go_on(server: ServerProc) -> None:
    owner = owner_pid(server)
    conn = connection_to(server, "1")  # the owner, stopped, would take new connections and never answer
    try:
        os.kill(owner, signal.SIGSTOP)
        try:
            started = time.monotonic()
            status, body, headers = send(
                conn, "POST", "/v1/indexes/docs/documents", {"documents": [doc(200)]}
            )
            took = time.monotonic() - started
            assert status == 503, body
            assert "front end '0' writes the index" in body["error"] and "no ping" in body["error"]
            assert headers.get("Retry-After") == "1"
            assert took < 30, f"the write waited {took:.1f} s for a hung owner"  # not the forward's 150 s
            status, body, _ = send(conn, "GET", "/v1/indexes/docs/documents/d5")
            assert status == 200 and body["id"] == "d5"
            status, body, _ = send(
                conn, "POST", "/v1/indexes/docs/search", {"query": "alpha", "k": 50, "mode": "lexical"}
            )
            assert status == 200 and {h["id"] for h in body["hits"]} == {f"d{i}" for i in range(DOCS)}
        finally:
            os.kill(owner, signal.SIGCONT)
    finally:
        conn.close()
    wait_for(lambda: both_up(server), 30, "both front ends up")


def refused_as_away(status: int, body: dict, headers: Message) -> bool:
    """A write refused with 503 and Retry-After while the owner is down and the parent (which runs the
    front ends' store) is stopped. The follower names front end 0 while the store's last word on the
    writer lease runs (its ttl), and the store once that has run out: a loaded machine may take that long
    between the parent's stop and the write (with the store silent, nobody can say who writes now)."""
    error = body.get("error", "")
    named = "front end '0' writes the index" in error or "the cluster store does not answer" in error
    return status == 503 and named and headers.get("Retry-After") == "1"


def test_with_the_owner_down_writes_get_503_and_reads_go_on(server: ServerProc) -> None:
    # after the hung owner of the test before: the owner takes writes again (one forwarded to it)
    before = forwarded(scrape(server))
    wait_for(
        lambda: write(server, 99, "zeta")[0] == 200 and forwarded(scrape(server)) > before, 60,
        "a write forwarded to the owner by the follower",
    )
    parent = server.proc.pid
    owner = owner_pid(server)
    os.kill(parent, signal.SIGSTOP)  # the parent would start the owner again at once
    try:
        os.kill(owner, signal.SIGKILL)
        wait_for(lambda: not alive(owner), 10, "the owner gone")
        answers: list[tuple[int, dict, Message]] = []
        wait_for(lambda: follower_answers(server, answers), 10, "the follower's answer to a write")
        assert refused_as_away(*answers[0]), answers[0][:2]
        for _ in range(4):  # only the follower listens now
            assert search_ids(server, "alpha") == {f"d{i}" for i in range(DOCS)}
        status, body = call(f"{server.url}/v1/indexes/docs/documents/d5")
        assert status == 200 and body["id"] == "d5"
    finally:
        os.kill(parent, signal.SIGCONT)
    taken: list[tuple[int, dict, Message]] = []
    wait_for(lambda: taken.append(write(server, 101, "gamma")) or taken[-1][0] == 200, 60, "writes again")
    wait_for(lambda: both_up(server), 60, "both front ends up")
    for _ in range(6):
        assert search_ids(server, "gamma", min_seq=taken[-1][1]["seq"]) == {"d101"}
        assert search_ids(server, "beta") == set()  # the refused write was not made
