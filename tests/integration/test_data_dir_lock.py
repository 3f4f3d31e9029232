"""Each server has its own data folder: `inferd serve --frontends 2` holds its --data-dir (its front ends
share it), and a second `inferd serve` given the same folder is refused at start, naming the first's
pid and address, with the fix; once the first is gone (stopped, or killed) the folder is free again."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, free_port, start_server


def serve(data_dir: Path) -> subprocess.CompletedProcess[str]:
    args = ["--model", "sim", "--workers", "0", "--port", str(free_port()), "--no-admin", "--no-grpc"]
    return subprocess.run(
        [sys.executable, "-m", "inferd.cli.main", "serve", *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_a_second_server_on_the_same_data_folder_is_refused_naming_the_first(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = start_server(tmp_path, "--model", "sim", "--frontends", "2", "--data-dir", str(data))
    try:
        second = serve(data)
        assert second.returncode == 2, second.stderr
        assert f"pid {first.proc.pid}" in second.stderr, second.stderr
        assert f"127.0.0.1:{first.port}" in second.stderr and "--data-dir" in second.stderr
    finally:
        first.stop()
    crashed = start_server(tmp_path, "--model", "sim", "--data-dir", str(data))
    workers = crashed.worker_pids()
    crashed.proc.send_signal(signal.SIGKILL)  # a crash: the kernel drops the lock
    crashed.proc.wait(10)
    crashed.stop()
    again = start_server(tmp_path, "--model", "sim", "--data-dir", str(data))
    again.stop()
    assert workers, "the killed server had its worker (which exits without it)"
