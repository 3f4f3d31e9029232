"""Two `inferd serve` processes sharing one Redis store (`--store redis://...`, tests/redis_server.py):
both show the store up; a reload on one is answered once the other has re-read its file; exactly one
holds the lease of the server's decisions, a scale asked of the other is carried out by it, and once it
is SIGKILLed the other takes it within the lease's time; Redis stopped and started again."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from inferd.gateway.keys import key_digest, new_key
from tests.checked_load import wait_for
from tests.conftest import ServerProc, free_port, start_server
from tests.frontends_harness import scrape
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)


def reload(server: ServerProc) -> dict:
    req = urllib.request.Request(f"{server.admin_url}/admin/reload", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def holds(server: ServerProc) -> bool:
    return scrape(server).get("inferd_cluster_lease_holder") == 1.0


def test_one_front_end_holds_the_lease_and_another_takes_it_when_it_dies(
    tmp_path: Path, redis_server: RedisServer  # noqa: F811
) -> None:
    (tmp_path / "inferd.toml").write_text("")
    servers = [
        start_server(
            tmp_path, "--model", "sim", "--workers", "1", "--store", redis_server.url,
            "--data-dir", str(tmp_path / f"data-{i}"), "--config", str(tmp_path / "inferd.toml"),
        )
        for i in range(2)
    ]
    try:
        for s in servers:
            assert scrape(s).get("inferd_cluster_store_up") == 1.0
        ids = sorted(f"127.0.0.1:{s.port}" for s in servers)
        wait_for(lambda: reload(servers[0])["frontends"]["reloaded"] == ids, 20, "a reload reaching both")
        wait_for(lambda: sum(holds(s) for s in servers) == 1, 20, "one holder")
        (holder,) = [s for s in servers if holds(s)]
        (other,) = [s for s in servers if s is not holder]
        status, answer = post(f"{other.admin_url}/admin/models/sim/scale?workers=2")  # carried out by the holder
        assert (status, answer) == (200, {"model": "sim", "workers": 2}), answer
        scaled = "scaling up from 1 to 2 local workers"
        assert scaled in holder.log() and scaled not in other.log()
        holder.proc.send_signal(signal.SIGKILL)
        holder.proc.wait(10)
        wait_for(lambda: holds(other), 20, "the other front end holding the lease")  # ttl 5 s, renewed every 1.7 s
    finally:
        stop_all(servers)


def stop_all(servers: list[ServerProc]) -> None:
    """Stop every server still running, each even when one before it did not stop cleanly (none outlives
    the test to load the next ones); then fail naming those that did not."""
    problems = []
    for s in servers:
        if s.proc.poll() is not None:
            continue
        try:
            code = s.stop()
        except AssertionError as exc:  # it did not stop on SIGTERM, or left workers: killed, and said
            problems.append(f"{s.port}: {exc}")
            continue
        if code not in (0, -15):
            problems.append(f"{s.port}: exit {code}")
    assert not problems, problems


def ask(server: ServerProc, key: str | None) -> int:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"{server.url}/v2/models/sim/infer", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def post(url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_redis_stopped_then_started_again(tmp_path: Path, redis_server: RedisServer) -> None:  # noqa: F811
    """Requests go on; changes answer 503 naming the store; a reload applies where it came, diverged;
    once Redis is back (empty: no persistence) the front ends converge: the other reads its file too."""
    config = tmp_path / "inferd.toml"
    config.write_text("")
    servers = [
        start_server(
            tmp_path, "--model", "sim", "--workers", "1", "--store", redis_server.url,
            "--data-dir", str(tmp_path / f"data-{i}"), "--config", str(config),
        )
        for i in range(2)
    ]
    try:
        wait_for(lambda: sum(holds(s) for s in servers) == 1, 20, "one holder")
        (holder,) = [s for s in servers if holds(s)]
        (other,) = [s for s in servers if s is not holder]
        redis_server.stop()
        wait_for(lambda: scrape(other).get("inferd_cluster_store_up") == 0.0, 10, "the store seen down")
        wait_for(lambda: not holds(holder), 10, "the holder no longer acting")  # within its lease time
        assert all(ask(s, None) == 200 for s in servers)  # serving goes on with the last state read
        status, answer = post(f"{holder.admin_url}/admin/models/sim/scale?workers=2")
        assert status == 503 and "cluster store" in answer["error"], answer

        key = new_key()
        config.write_text(f'[tenants.acme]\napi_key_sha256 = ["{key_digest(key)}"]\n')
        status, answer = post(f"{holder.admin_url}/admin/reload")
        assert status == 200 and answer["diverged"] is True, answer
        assert scrape(holder).get("inferd_cluster_config_diverged") == 1.0
        assert ask(holder, None) == 401 and ask(holder, key) == 200  # a revoked or added key works at once
        assert ask(other, None) == 200  # not reloaded: diverged

        redis_server.start()  # on the same port, empty
        wait_for(lambda: all(scrape(s).get("inferd_cluster_store_up") == 1.0 for s in servers), 20, "the store up")
        wait_for(lambda: scrape(holder).get("inferd_cluster_config_diverged") == 0.0, 20, "converged")
        wait_for(lambda: ask(other, None) == 401, 20, "the other front end's file re-read")
        assert ask(other, key) == 200
        wait_for(lambda: sum(holds(s) for s in servers) == 1, 20, "a holder again")
    finally:
        stop_all(servers)


def admin_get(server: ServerProc, path: str) -> dict:
    with urllib.request.urlopen(f"{server.admin_url}{path}", timeout=30) as r:
        return json.loads(r.read())


def test_front_ends_with_different_model_repositories_are_reported(
    tmp_path: Path, redis_server: RedisServer  # noqa: F811
) -> None:
    """Reported on GET /admin/cluster (and in each one's log), not silently split."""
    repos = []
    for i, base_ms in enumerate((5.0, 7.0)):  # the same model, configured differently
        repo = tmp_path / f"repo-{i}"
        (repo / "sim" / "1").mkdir(parents=True)
        (repo / "sim" / "model.toml").write_text(f'builtin = "sim"\nworkers = 1\n\n[params]\nbase_ms = {base_ms}\n')
        repos.append(repo)
    servers = [
        start_server(tmp_path, "--model-repo", str(repo), "--store", redis_server.url, "--data-dir", str(tmp_path / f"data-{i}"))
        for i, repo in enumerate(repos)
    ]
    try:
        ids = sorted(f"127.0.0.1:{s.port}" for s in servers)
        wait_for(lambda: all(admin_get(s, "/admin/cluster")["repository_mismatch"] for s in servers), 20, "the mismatch seen")
        for s in servers:
            view = admin_get(s, "/admin/cluster")
            assert [f["id"] for f in view["frontends"]] == ids and view["shared"] is True
            mismatch = view["repository_mismatch"]
            assert sorted(g["frontends"] for g in mismatch["groups"]) == [[ids[0]], [ids[1]]]
            assert mismatch["differing"] == ["sim/1"] and "same --model-repo" in mismatch["message"]
            assert "front ends serve different model repositories" in s.log()
    finally:
        stop_all(servers)


def test_local_workers_join_every_front_end_and_follow_an_update(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """With a join token, each front end's local worker joins both (the same fleet on both); an update
    rolled by the holder replaces its own, and the other's local worker of the retired version moves to
    the new one (FleetControl.move_slots): no worker is left on a version nobody serves."""
    monkeypatch.setenv("INFERD_JOIN_TOKEN", "join-secret-for-the-mesh")
    repo = tmp_path / "repo"
    (repo / "sim" / "1").mkdir(parents=True)
    (repo / "sim" / "model.toml").write_text('builtin = "sim"\nworkers = 1\n\n[params]\nbase_ms = 2.0\n')
    servers = [
        start_server(
            tmp_path, "--model-repo", str(repo), "--store", redis_server.url, "--worker-port", str(free_port()),
            "--data-dir", str(tmp_path / f"data-{i}"),
        )
        for i in range(2)
    ]

    def fleet(s: ServerProc) -> list[tuple[int, str]]:
        return sorted((w["version"], w["state"]) for w in admin_get(s, "/admin/models")["models"]["sim"]["fleet"])

    try:
        # the second started after the first's worker: the first's next worker joins it (below)
        wait_for(lambda: all(len(fleet(s)) >= 1 for s in servers), 30, "a worker on each front end")
        wait_for(lambda: sum(holds(s) for s in servers) == 1, 20, "one holder")
        (holder,) = [s for s in servers if holds(s)]
        (other,) = [s for s in servers if s is not holder]
        (repo / "sim" / "2").mkdir()
        status, answer = post(f"{other.admin_url}/admin/models/sim/update?version=2")
        assert status == 200 and answer["to"] == 2, answer
        # the holder's new worker joined both; the other's worker of version 1 moved to 2 and joins both
        wait_for(lambda: all(fleet(s) == [(2, "ready"), (2, "ready")] for s in servers), 60, "both workers at 2 on both")
        ids = {s.port: sorted(w["worker_id"] for w in admin_get(s, "/admin/models")["models"]["sim"]["fleet"]) for s in servers}
        assert ids[holder.port] == ids[other.port], ids
        assert "local worker(s) of version 1 move to version 2" in other.log()
        assert all(ask(s, None) == 200 for s in servers)
    finally:
        stop_all(servers)
