"""A search index served by front ends on two hosts, its writer SIGKILLed while writes go through every
front end, with real processes in network namespaces (tests/lan.py, tests/netns_cluster.py): a Redis
host, two front-end hosts (each front end runs one replica of each shard of index `docs`, 2 shards, and
its replica workers join both front ends with the join token) and a worker host (one more replica of
each shard, `inferd worker --model docs`, joined to both front ends).

Writes go through both front ends (each client one front end, one new document per request, every id
unique). The front end that writes the index (the holder of the lease `search-writer/docs`, read in
Redis) is SIGKILLed with its replica workers (its host's processes, as a host lost). Then:

* a write through the other front end is refused meanwhile only with 503 and a Retry-After, and is
  acknowledged again once that front end took the lease over (within its ttl and the takeover);
* the only writes with no answer are those the killed front end held;
* every acknowledged document is found exactly once through the surviving front end: a search for its
  own word finds it once, a GET finds it, and the index holds no more documents than were written.

Every wait is bounded; every process is stopped and every namespace removed at the end, also after a
failure."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from inferd.cluster.redis_store import RedisStore
from inferd.kinds.search.writers import writer_lease
from tests.checked_load import wait_for
from tests.lan import Lan
from tests.netns_cluster import (
    ADMIN_PORT,
    HTTP_PORT,
    REDIS_PORT,
    WORKER_PORT,
    Cluster,
    FrontEnd,
    Proc,
    connect_list,
    redis_proc,
    start_redis,
    wait_live,
)

INDEX = """kind = "search"
[search]
shards = 2
replicas = 1
embedder = "none"
"""
WORD = "everydoc"
BEFORE_S = 3.0
"""Writes before the kill."""
AFTER_S = 2.0
"""Writes after the first one acknowledged after the kill."""


def call(url: str, method: str = "GET", body: object = None, timeout_s: float = 30.0) -> tuple[int, dict, str]:
    """(status, JSON body, Retry-After); status 0 when no answer came (the connection failed)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null"), r.headers.get("Retry-After", "")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null"), exc.headers.get("Retry-After", "")
    except OSError as exc:
        return 0, {"error": repr(exc)}, ""


@dataclass
class Written:
    front_end: str
    doc: str
    sent_at: float
    status: int
    retry_after: str


@dataclass
class Writes:
    """One client per front end and a few more: each writes one new document per request until `stop`."""

    front_ends: list[FrontEnd]
    per_front_end: int = 2
    done: list[Written] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, fe: FrontEnd, c: int) -> None:
        n = 0
        while not self.stop.is_set():
            doc = f"{fe.id.replace('-', '')}c{c}n{n}"  # one token: a search for it finds it
            sent = time.monotonic()
            body = {"documents": [{"id": doc, "text": f"{WORD} {doc}"}]}
            status, _, retry = call(f"{fe.url}/v1/indexes/docs/documents", "POST", body, 60.0)
            with self.lock:
                self.done.append(Written(fe.id, doc, sent, status, retry))
            n += 1
            if status != 200:
                time.sleep(0.1)

    def start(self) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self.client, args=(fe, c), daemon=True)
            for fe in self.front_ends
            for c in range(self.per_front_end)
        ]
        for t in threads:
            t.start()
        return threads

    def acked_since(self, at: float) -> bool:
        with self.lock:
            return any(w.status == 200 and w.sent_at >= at for w in self.done)


def serve_argv(fe: str, address: str, root: str, redis: str) -> list[str]:
    return [
        *(sys.executable, "-m", "inferd.cli.main", "serve", "--host", address, "--port", str(HTTP_PORT)),
        *("--admin-host", address, "--admin-port", str(ADMIN_PORT)),
        *("--worker-host", address, "--worker-port", str(WORKER_PORT), "--insecure"),
        *("--store", f"redis://{redis}:{REDIS_PORT}/0", "--data-dir", f"{root}/data-{fe}"),
        *("--frontend-id", fe, "--model-repo", f"{root}/repo", "--shutdown-grace-s", "0"),
    ]


def writer_of_docs(redis: str) -> str | None:
    """The holder of the lease `search-writer/docs`, as Redis says."""

    async def read() -> str | None:
        store = RedisStore(f"redis://{redis}:{REDIS_PORT}/0", timeout_s=2.0)
        try:
            grant = await store.holder(writer_lease("docs"))
        finally:
            await store.close()
        return None if grant is None else grant.holder

    return asyncio.run(read())


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    root = tmp_path_factory.mktemp("search-hosts-netns")
    (root / "repo" / "docs").mkdir(parents=True)
    (root / "repo" / "docs" / "model.toml").write_text(INDEX)
    with Lan() as lan:
        fe_hosts = [lan.host(f"sfe-{x}") for x in "ab"]
        worker_host, redis_host = lan.host("swk"), lan.host("sredis")
        front_ends = [
            FrontEnd(f"fe-{x}", h, serve_argv(f"fe-{x}", h.address, str(root), redis_host.address),
                     root / f"fe-{x}.log", id=f"fe-{x}")
            for x, h in zip("ab", fe_hosts, strict=True)
        ]  # fmt: skip
        c = Cluster(root, redis_proc(redis_host, root), front_ends)
        with c.running(log_tail=3000):
            start_redis(c.redis)
            for fe in front_ends:
                fe.start()
            for fe in front_ends:
                wait_live(fe, 90)
            c.workers = [
                Proc(
                    f"w{i}", worker_host,
                    [sys.executable, "-m", "inferd.cli.main", "worker", "--connect", connect_list(front_ends),
                     "--model", "docs", "--worker-id", f"w{i}", "--insecure"],
                    root / f"w{i}.log",
                )
                for i in (1, 2)
            ]
            for w in c.workers:
                w.start()
            for fe in front_ends:  # every front end takes a write: a writer is there and reachable
                wait_for(lambda fe=fe: call(f"{fe.url}/v1/indexes/docs/documents", "POST",
                                            {"documents": [{"id": "warm", "text": WORD}]})[0] == 200,
                         90, f"a write through {fe.id}")  # fmt: skip
            yield c, redis_host.address


def test_every_acknowledged_write_is_found_once_after_the_writers_sigkill(cluster: tuple[Cluster, str]) -> None:
    c, redis = cluster
    writes = Writes(c.front_ends)
    threads = writes.start()
    time.sleep(BEFORE_S)
    holder = writer_of_docs(redis)
    (victim,) = [fe for fe in c.front_ends if fe.id == holder]
    (survivor,) = [fe for fe in c.front_ends if fe is not victim]
    killed_at = time.monotonic()
    victim.kill()  # the front end and its replica workers: its host's processes
    wait_for(lambda: writes.acked_since(killed_at), 60, "a write acknowledged after the writer's SIGKILL")
    time.sleep(AFTER_S)
    writes.stop.set()
    for t in threads:
        t.join(90)
    assert writer_of_docs(redis) == survivor.id

    done = writes.done
    acked = {w.doc for w in done if w.status == 200}
    through_survivor = [w for w in done if w.front_end == survivor.id]
    assert {w.status for w in through_survivor} <= {200, 503}, sorted({w.status for w in through_survivor})
    assert all(w.retry_after for w in through_survivor if w.status == 503)  # each refusal says when again
    assert any(w.status == 503 for w in through_survivor if w.sent_at >= killed_at)  # there was no writer
    assert {w.status for w in done if w.front_end == victim.id} <= {200, 503, 0}  # 0: held by the killed
    assert any(w.status == 200 and w.sent_at >= killed_at for w in through_survivor)
    assert len(acked) > 20

    for doc in sorted(acked):  # found exactly once through the surviving front end
        status, body, _ = call(f"{survivor.url}/v1/indexes/docs/search", "POST", {"query": doc, "k": 10, "mode": "lexical"})
        assert status == 200, body
        assert [h["id"] for h in body["hits"]].count(doc) == 1, (doc, body["hits"])
        assert call(f"{survivor.url}/v1/indexes/docs/documents/{doc}")[0] == 200, doc
    status, index, _ = call(f"{survivor.url}/v1/indexes/docs")
    assert status == 200
    tried = {w.doc for w in done} | {"warm"}
    assert len(acked) <= index["documents"] <= len(tried), (index["documents"], len(acked), len(tried))
