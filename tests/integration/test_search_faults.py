"""Search under faults, with real processes: the server SIGKILLed during ingest (every acknowledged
document is there after the restart, none twice, and an API-created index is served again), a replica
SIGKILLed under load (no errors), every replica of one shard stopped (partial coverage, not errors), and
the embedder killed (every search answered, lexically and flagged degraded, then hybrid again)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ServerProc, start_server
from tests.integration.search_fixtures import call, doc, model_repo, wait_serving


def serve(tmp: Path, replicas: int, *extra: str) -> ServerProc:
    repo = tmp / "models" if (tmp / "models").exists() else model_repo(tmp, replicas)
    return start_server(tmp, "--model-repo", str(repo), "--data-dir", str(tmp / "data"), *extra)


def test_sigkill_during_ingest_loses_no_acknowledged_document(tmp_path: Path) -> None:
    server = serve(tmp_path, 1)
    acked: list[str] = []
    stop = threading.Event()
    try:
        wait_serving(server.url, "docs", [1, 1])
        assert (
            call(f"{server.url}/v1/indexes/extra", "PUT", {"shards": 1, "replicas": 1, "embedder": "none"})[0]
            == 201
        )
        call(f"{server.url}/v1/indexes/extra/documents", "POST", {"documents": [doc(1, "kept")]})

        def ingest() -> None:
            for batch in range(200):
                if stop.is_set():
                    return
                docs = [doc(batch * 10 + i, f"tok{batch * 10 + i}") for i in range(10)]
                try:
                    status, _ = call(f"{server.url}/v1/indexes/docs/documents", "POST", {"documents": docs})
                except OSError:
                    return
                if status == 200:
                    acked.extend(d["id"] for d in docs)

        writer = threading.Thread(target=ingest)
        writer.start()
        deadline = time.monotonic() + 30
        while len(acked) < 150 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGKILL)
        stop.set()
        writer.join(30)
        server.proc.wait(10)
    finally:
        stop.set()
        server.stop()
    assert len(acked) >= 150
    server = serve(tmp_path, 1, "--port", str(server.port))
    try:
        state = wait_serving(server.url, "docs", [1, 1])
        deadline = time.monotonic() + 30
        while state["applied_seq"] != state["seq"] and time.monotonic() < deadline:  # replaying its log
            time.sleep(0.05)
            state = call(f"{server.url}/v1/indexes/docs")[1]
        assert len(acked) <= state["documents"] <= len(acked) + 10  # at most the batch in flight more
        for doc_id in acked:
            n = int(doc_id[1:])
            status, found = call(
                f"{server.url}/v1/indexes/docs/search", "POST", {"query": f"tok{n}", "mode": "lexical"}
            )
            assert status == 200, found
            assert [h["id"] for h in found["hits"]] == [doc_id]  # found, and once
        _, kept = call(f"{server.url}/v1/indexes/extra/search", "POST", {"query": "kept", "mode": "lexical"})
        assert [h["id"] for h in kept["hits"]] == ["d1"]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    server = serve(tmp_path_factory.mktemp("faults"), 2)
    wait_serving(server.url, "docs", [2, 2])
    docs = [doc(i, "zebra") for i in range(40)]
    assert call(f"{server.url}/v1/indexes/docs/documents", "POST", {"documents": docs})[0] == 200
    yield server
    assert server.stop() in (0, -15)


def searches(
    server: ServerProc, n: int, mode: str = "hybrid", timeout_ms: int = 3000
) -> list[tuple[int, dict]]:
    return [
        call(
            f"{server.url}/v1/indexes/docs/search",
            "POST",
            {"query": f"zebra number{i}", "mode": mode, "timeout_ms": timeout_ms},
        )
        for i in range(n)
    ]


def test_replica_killed_under_load_costs_no_search(loaded: ServerProc) -> None:
    victim = wait_serving(loaded.url, "docs", [2, 2])["workers"][0][0]["pid"]
    results: list[tuple[int, dict]] = []
    load = threading.Thread(target=lambda: results.extend(searches(loaded, 150)))
    load.start()
    time.sleep(0.2)
    os.kill(victim, signal.SIGKILL)
    load.join(60)
    assert [s for s, _ in results] == [200] * 150
    assert all(b["coverage"] == {"shards": 2, "answered": 2} for _, b in results)
    wait_serving(loaded.url, "docs", [2, 2])  # the supervisor replaced it; it caught up


def test_shard_without_replicas_gives_partial_coverage(loaded: ServerProc) -> None:
    shard0 = [w["pid"] for w in wait_serving(loaded.url, "docs", [2, 2])["workers"][0]]
    for pid in shard0:
        os.kill(pid, signal.SIGSTOP)
    try:
        status, body = call(
            f"{loaded.url}/v1/indexes/docs/search",
            "POST",
            {"query": "zebra", "mode": "lexical", "timeout_ms": 300},
        )
    finally:
        for pid in shard0:
            os.kill(pid, signal.SIGCONT)
    assert status == 200, body
    assert body["coverage"] == {"shards": 2, "answered": 1}
    assert body["hits"]


def test_embedder_killed_every_search_answered_degraded_then_hybrid(loaded: ServerProc) -> None:
    assert all(b["degraded"] == [] for _, b in searches(loaded, 3))
    embedder = [
        p for p in loaded.worker_pids() if "--model\x00embedder" in Path(f"/proc/{p}/cmdline").read_text()
    ]
    os.kill(embedder[0], signal.SIGKILL)
    seen: list[list[str]] = []
    deadline = time.monotonic() + 30
    recovered_at = None
    while time.monotonic() < deadline:
        status, body = call(
            f"{loaded.url}/v1/indexes/docs/search",
            "POST",
            {"query": f"zebra {len(seen)}", "timeout_ms": 3000},
        )
        assert status == 200, body
        assert body["coverage"]["answered"] == 2
        seen.append(body["degraded"])
        if (
            recovered_at is None
            and call(f"{loaded.url}/v2/models/embedder/ready")[0] == 200
            and ["dense"] in seen
        ):
            recovered_at = time.monotonic()
        if recovered_at is not None and body["degraded"] == []:
            break
        time.sleep(0.05)
    assert ["dense"] in seen
    assert recovered_at is not None and seen[-1] == [], seen[-5:]
    assert time.monotonic() - recovered_at <= 5.0
    _, dense = call(f"{loaded.url}/v1/indexes/docs/search", "POST", {"query": "zebra again", "mode": "dense"})
    assert dense["degraded"] == []
