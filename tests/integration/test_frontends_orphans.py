"""`inferd serve --frontends 2` killed past cleanup: SIGKILL of the parent, then of the front ends.

The local workers rejoin lost front ends (`--reconnect`, so that they outlive an owner that dies); with
the parent gone too, nobody adopts them any more. Each must see that its server is gone (its parent is
neither the owner that started it nor the server's parent, worker/orphans.py) and exit, letting go of
its device, instead of retrying forever. Bounded: one server, no load."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from tests.checked_load import wait_for
from tests.conftest import alive, child_pids, start_server
from tests.integration.test_frontends_owner import CONFIG, ready_workers, worker_processes


def socket_folder(pid: int) -> str | None:
    """The server's socket folder, from a worker's `--connect unix:FOLDER/workers-0.sock,...`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    first = args[args.index("--connect") + 1].split(",")[0]
    return os.path.dirname(first.removeprefix("unix:"))


def test_workers_exit_once_the_parent_and_then_every_front_end_are_killed(tmp_path: Path) -> None:
    config = tmp_path / "inferd.toml"
    config.write_text(CONFIG)
    server = start_server(
        tmp_path, "--model", "sim", "--workers", "2", "--frontends", "2", "--config", str(config)
    )
    workers: set[int] = set()
    front_ends: list[int] = []
    folder = None
    try:
        wait_for(lambda: len(ready_workers(server)) == 2, 30, "two ready workers")
        workers = worker_processes(server)
        assert len(workers) == 2, workers
        assert "--reconnect" in open(f"/proc/{min(workers)}/cmdline", "rb").read().decode()
        folder = socket_folder(min(workers))
        front_ends = [p for p in child_pids(server.proc.pid) if alive(p)]
        assert len(front_ends) == 2, front_ends
        server.proc.send_signal(signal.SIGKILL)  # the parent: killed with no cleanup (as by the OOM killer)
        server.proc.wait(10)
        assert all(alive(p) for p in workers)  # the owner still runs them
        for pid in front_ends:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not any(alive(p) for p in front_ends), 10, "the front ends gone")
        wait_for(lambda: not any(alive(p) for p in workers), 30, "every orphaned worker exited")
        assert server.log().count("the server that started it is gone") >= 2
    finally:
        for pid in [*front_ends, *workers]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if folder and os.path.basename(folder).startswith("inferd-"):
            shutil.rmtree(folder, ignore_errors=True)
