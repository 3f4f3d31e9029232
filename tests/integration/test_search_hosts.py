"""Two `inferd serve` front ends on loopback sharing one redis-server (`--store`), as on two hosts, serving
a search index (2 shards x 2 replicas of each front end's own, joining, with the join token, every front
end whose record they find when they start: those of the second front end join both):

* exactly one front end writes the index (it holds the lease `search-writer/docs`); writes through the
  other are forwarded to it over TCP (the address in its record `frontend/<id>`, with the join token) and
  acknowledged with its answer; the writer counts them, and searches through either front end find
  every one;
* a bad body sent to the other front end is its own 400 and is never forwarded;
* an index created through the front end that does not hold the `decider` lease is created by the one
  that does, and served by both; deleted through it, gone from both (one `kind/search/indexes` document
  for the whole server).

Bounded: one server pair, a few dozen requests, every wait capped."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from tests.checked_load import wait_for
from tests.conftest import ServerProc, free_port, start_server
from tests.frontends_harness import scrape
from tests.integration.search_fixtures import call, doc
from tests.redis_server import RedisServer

INDEX = """
kind = "search"
[search]
shards = 2
replicas = 2
embedder = "none"
"""
DOCS = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProc]]:
    tmp = tmp_path_factory.mktemp("search-hosts")
    (tmp / "models" / "docs").mkdir(parents=True)
    (tmp / "models" / "docs" / "model.toml").write_text(INDEX)
    redis = RedisServer()
    redis.start()
    before = os.environ.get("INFERD_JOIN_TOKEN")
    os.environ["INFERD_JOIN_TOKEN"] = secrets.token_hex(16)  # the servers' environment (start_server's)
    servers: list[ServerProc] = []
    try:
        for i in range(2):
            servers.append(
                start_server(
                    tmp, "--model-repo", str(tmp / "models"), "--data-dir", str(tmp / f"data-{i}"),
                    "--store", redis.url, "--worker-host", "127.0.0.1", "--worker-port", str(free_port()),
                    ready_timeout_s=90.0,
                )
            )
        yield servers
    finally:
        for s in servers:
            s.stop()
        redis.stop()
        if before is None:
            os.environ.pop("INFERD_JOIN_TOKEN", None)
        else:
            os.environ["INFERD_JOIN_TOKEN"] = before


def forwarded(server: ServerProc, op: str = "") -> float:
    """The search writes forwarded to `server`, whatever their outcome."""
    name = "inferd_search_forwarded_writes_total{"
    return sum(v for k, v in scrape(server).items() if (k.startswith(name) and f'op="{op}"' in k) or (not op and k.startswith(name)))


def writer_and_other(pair: list[ServerProc]) -> tuple[ServerProc, ServerProc]:
    """(the front end that writes index docs, the other): the one a write through the other went to."""
    wait_for(lambda: all(call(f"{s.url}/v1/indexes/docs/documents", "POST", {"documents": [doc(900)]})[0] == 200
                         for s in pair), 60, "writes taken through both front ends")  # fmt: skip
    counts = [forwarded(s) for s in pair]
    assert sorted(c > 0 for c in counts) == [False, True], counts  # one front end got the other's write
    return (pair[0], pair[1]) if counts[0] else (pair[1], pair[0])


def test_writes_through_either_front_end_are_written_by_the_one_writer(pair: list[ServerProc]) -> None:
    writer, other = writer_and_other(pair)
    before = forwarded(writer, "upsert")
    seqs = []
    for i in range(DOCS):
        through = (writer, other)[i % 2]
        status, body = call(f"{through.url}/v1/indexes/docs/documents", "POST", {"documents": [doc(i, "alpha")]})
        assert status == 200 and body["documents"] == 1, body
        seqs.append(body["seq"])
    assert forwarded(writer, "upsert") == before + DOCS // 2
    assert forwarded(other) == 0  # nothing went the other way
    latest = [max(s[shard] for s in seqs) for shard in range(2)]
    for s in (writer, other):  # read through either front end, from the replicas
        status, found = call(
            f"{s.url}/v1/indexes/docs/search", "POST", {"query": "alpha", "k": 50, "mode": "lexical", "min_seq": latest}
        )
        assert status == 200 and sorted(h["id"] for h in found["hits"]) == sorted(f"d{i}" for i in range(DOCS))


def test_a_bad_body_is_the_receiving_front_ends_400_and_never_forwarded(pair: list[ServerProc]) -> None:
    writer, other = writer_and_other(pair)
    before = forwarded(writer)
    status, body = call(f"{other.url}/v1/indexes/docs/documents", "POST", {"documents": [{"id": "x", "text": 5}]})
    assert status == 400 and "text and title must be strings" in body["error"], body
    status, body = call(f"{other.url}/v1/indexes/other", "PUT", {"shards": 0, "embedder": "none"})
    assert status == 400 and "shards" in body["error"], body
    assert forwarded(writer) == before


def test_an_index_created_and_deleted_through_either_front_end_is_so_on_both(pair: list[ServerProc]) -> None:
    holders = [s for s in pair if scrape(s).get("inferd_cluster_lease_holder") == 1.0]
    assert len(holders) == 1
    (decider,) = holders
    (other,) = [s for s in pair if s is not decider]
    before = forwarded(decider, "create")
    url = f"{other.url}/v1/indexes/notes"
    status, body = call(url, "PUT", {"shards": 1, "replicas": 1, "embedder": "none"})
    assert status == 201, body
    assert forwarded(decider, "create") == before + 1  # created by the decider lease's holder
    for s in pair:
        wait_for(lambda s=s: call(f"{s.url}/v1/indexes/notes")[0] == 200, 20, "the index served on both")
    status, body = call(url, "DELETE")
    assert status == 200 and body == {"deleted": "notes"}, body
    for s in pair:
        wait_for(lambda s=s: call(f"{s.url}/v1/indexes/notes")[0] == 404, 20, "the index gone from both")
