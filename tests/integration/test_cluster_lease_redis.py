"""Two `inferd serve` processes sharing one Redis store (`--store redis://...`, tests/redis_server.py):
both show the store up; a reload on one is answered once the other has re-read its file; exactly one
holds the lease of the server's decisions, and once it is SIGKILLed the other takes it within the
lease's time."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

from tests.checked_load import wait_for
from tests.conftest import ServerProc, start_server
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
        holder.proc.send_signal(signal.SIGKILL)
        holder.proc.wait(10)
        wait_for(lambda: holds(other), 20, "the other front end holding the lease")  # ttl 5 s, renewed every 1.7 s
    finally:
        for s in servers:
            if s.proc.poll() is None:
                assert s.stop() in (0, -15)
