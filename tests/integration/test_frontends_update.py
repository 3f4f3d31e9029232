"""A rolling update with `inferd serve --frontends 2`: the owner runs it, and the other front end follows
(cluster/served.py): it serves the new version before the new workers join it, moves its default
with the owner's, and retires the old version with it. Under checked load (each request on a new
connection, so both front ends take them): every answer is a 200 whose digest is its version's, every
request sent once the update answered is answered by version 2, on both front ends; a follower killed
after the update comes back serving version 2; so does the owner killed after it (cluster/saved.py),
with the same version-2 workers, adopted, not the config's version 1. An owner killed while its update
waits for the first new worker comes back with the update undone: version 1 on the same two workers,
the new version's starting worker stopped, every answer correct.

Bounded: one server, a load capped in count and time, every wait bounded."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from inferd.cluster.local import LocalStoreClient
from inferd.cluster.served import SERVED
from tests.checked_load import Load, infer, wait_for
from tests.conftest import ServerProc, alive, child_pids, start_server
from tests.frontends_harness import ready_workers, scrape
from tests.integration.test_frontends import frontend_pids
from tests.integration.test_frontends_owner import worker_processes

MODEL_TOML = """builtin = "sim"
workers = 2
max_batch_size = 8
max_wait_ms = 2

[params]
base_ms = 10.0
"""


def ok_v2(sample: dict[str, float], frontend: str) -> float:
    return sum(
        v
        for k, v in sample.items()
        if k.startswith("inferd_requests_total{")
        and f'frontend="{frontend}"' in k
        and 'version="2"' in k
        and 'outcome="ok"' in k
    )


def restarted(server: ServerProc, owner: int, killed: int) -> bool:
    return bool(
        {p for p in child_pids(server.proc.pid) if alive(p) and child_pids(p) == []} - {owner, killed}
    )


def answers_with_version_2(server: ServerProc, frontend: str) -> None:
    """Requests on new connections until the restarted `frontend` has answered some (its counters start
    anew): every answer is correct and from version 2."""
    replies = []
    deadline = time.monotonic() + 30
    while ok_v2(scrape(server), frontend) == 0 and time.monotonic() < deadline:
        replies += [infer(server.url, f"r{frontend}-{len(replies)}") for _ in range(10)]
    assert ok_v2(scrape(server), frontend) > 0, (
        f"restarted front end {frontend} answered nothing with version 2"
    )
    wrong = [r for r in replies if r is None or not r.correct or r.version != "2"]
    assert not wrong, wrong[:5]


def ready_or_none(server: ServerProc) -> list[dict]:
    try:
        return ready_workers(server)
    except OSError:
        return []  # the owner (which serves the admin API) is not there


def two_front_ends_with_a_repository(tmp_path: Path) -> tuple[Path, ServerProc]:
    """`--frontends 2` over a model repository holding version 1 of sim, its two workers ready."""
    repo = tmp_path / "repo"
    (repo / "sim" / "1").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text(MODEL_TOML)
    server = start_server(tmp_path, "--model-repo", str(repo), "--frontends", "2")
    try:
        wait_for(lambda: len(ready_workers(server)) == 2, 30, "two ready workers")
    except BaseException:
        server.stop()
        raise
    return repo, server


def update(server: ServerProc) -> tuple[int, dict]:
    req = urllib.request.Request(f"{server.admin_url}/admin/models/sim/update", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_rolling_update_reaches_every_front_end(tmp_path: Path) -> None:
    repo, server = two_front_ends_with_a_repository(tmp_path)
    try:
        with Load(server.url, "u", clients=4, max_requests=4000, max_s=40) as load:
            wait_for(lambda: load.answered() >= 40, 20, "answers before the update")
            shutil.copytree(repo / "sim" / "1", repo / "sim" / "2")
            status, result = update(server)
            updated_at = time.monotonic()
            seen = load.answered()
            wait_for(lambda: load.answered() >= seen + 100, 20, "answers after the update")
        assert (status, result) == (200, {"model": "sim", "from": 1, "to": 2, "replaced": 2})
        assert sorted(w["version"] for w in ready_workers(server)) == [2, 2]
        assert not load.unanswered, load.unanswered[:5]
        failed = [a for a in load.answers if not a.correct]
        assert not failed, failed[:5]
        after = [a.version for a in load.answers if a.sent_at > updated_at]
        assert len(after) >= 50 and set(after) == {"2"}
        assert {"1", "2"} <= {a.version for a in load.answers}
        sample = scrape(server)
        assert ok_v2(sample, "0") > 0 and ok_v2(sample, "1") > 0, {
            k: v for k, v in sample.items() if k.startswith("inferd_requests_total")
        }

        owner, follower = frontend_pids(server)
        os.kill(follower, signal.SIGKILL)
        wait_for(lambda: restarted(server, owner, follower), 20, "the killed front end started again")
        answers_with_version_2(server, "1")

        wait_for(lambda: len(worker_processes(server)) == 2, 10, "the version-1 workers gone")
        workers = worker_processes(server)
        owner, _ = frontend_pids(server)
        os.kill(owner, signal.SIGKILL)
        wait_for(lambda: not alive(owner), 10, "the owner gone")
        wait_for(lambda: len(ready_or_none(server)) == 2, 60, "the owner back with two ready workers")
        assert sorted(w["version"] for w in ready_workers(server)) == [2, 2]
        assert worker_processes(server) == workers  # adopted at version 2, none started at version 1
        assert "serving version(s) [2] (default 2) with worker slots {2: [2, 3]}" in server.log()
        answers_with_version_2(server, "0")
    finally:
        assert server.stop() in (0, -15)
    assert "is not served" not in server.log()


def worker_arg(pid: int, flag: str) -> str:
    """The value of `flag` on a worker process's command line."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return args[args.index(flag.encode()) + 1].decode()


def server_folder(server: ServerProc) -> Path:
    """The parent's folder (the local workers connect to its sockets)."""
    for pid in worker_processes(server):
        return Path(worker_arg(pid, "--connect").split(",")[0].removeprefix("unix:")).parent
    raise AssertionError("no worker process")


def versions_of(pids: set[int]) -> list[str]:
    return sorted(worker_arg(pid, "--model-version") for pid in pids)


def served_updating(server: ServerProc) -> list[int]:
    """The rolling update the served document (in the parent's store, cluster/local.py) says runs."""
    (pid, *_) = worker_processes(server)
    store = LocalStoreClient(str(server_folder(server) / "store.sock"), worker_arg(pid, "--token"))

    async def read() -> list[int]:
        try:
            _, state = await SERVED.read(store)
        finally:
            await store.close()
        return state.models["sim"].updating if "sim" in state.models else []

    return asyncio.run(read())


def test_an_update_cut_short_by_the_owners_death_is_undone(tmp_path: Path) -> None:
    repo, server = two_front_ends_with_a_repository(tmp_path)
    try:
        old = worker_processes(server)
        shutil.copytree(repo / "sim" / "1", repo / "sim" / "2")
        with (repo / "sim" / "model.toml").open("a") as f:
            f.write("\n[versions.2.params]\nload_ms = 8000.0\n")  # its first worker is not ready in time
        with Load(server.url, "c", clients=4, max_requests=6000, max_s=90) as load:
            wait_for(lambda: load.answered() >= 40, 20, "answers before the update")
            cut = threading.Thread(target=lambda: update_cut_short(server), daemon=True)
            cut.start()
            wait_for(lambda: served_updating(server) == [1, 2, 2], 20, "the update saved as running")
            wait_for(lambda: "2" in versions_of(worker_processes(server)), 20, "the new version's worker")
            owner, _ = frontend_pids(server)
            os.kill(owner, signal.SIGKILL)
            wait_for(lambda: not alive(owner), 10, "the owner gone")
            wait_for(lambda: len(ready_or_none(server)) == 2, 60, "the owner back with two ready workers")
            # SIGTERM drains the new version's worker: it finishes loading (8 s), then exits
            wait_for(lambda: worker_processes(server) == old, 40, "the new version's worker stopped")
            back = load.answered()
            wait_for(lambda: load.answered() >= back + 100, 30, "answers with the owner back")
        cut.join(10)
        assert sorted(w["version"] for w in ready_workers(server)) == [1, 1]
        assert "serving version(s) [1] (default 1) with worker slots {1: [0, 1]}" in server.log()
        wrong = [a for a in load.answers if not a.correct or a.version != "1"]
        assert not wrong, wrong[:5]
        assert len(load.unanswered) <= 12, load.unanswered  # connection errors: those the owner had taken
        answers = [infer(server.url, f"after-{i}") for i in range(20)]  # new connections: both front ends
        assert all(a is not None and a.correct and a.version == "1" for a in answers), answers
    finally:
        assert server.stop() in (0, -15)
    assert "is not served" not in server.log()


def update_cut_short(server: ServerProc) -> None:
    """The update's call, whose owner dies under it: a connection error, not an answer."""
    try:
        status, result = update(server)
    except (OSError, http.client.HTTPException):
        return
    raise AssertionError(f"the update answered {status} {result} though its owner died")
