"""One server per data folder (data_lock.py): the lock is held for the process's life, a second holder
is refused naming the first one's pid and address with the fix, and a holder that ended (a crash
included) leaves the folder free."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferd.config import ConfigError
from inferd.data_lock import LOCK_NAME, hold_data_dir

HOLD = """
import sys, time
from pathlib import Path
from inferd.data_lock import hold_data_dir
hold_data_dir(Path(sys.argv[1]), "10.0.0.9:8000", "fe-9")
print("held", flush=True)
time.sleep(120)
"""


def holder(data_dir: Path) -> subprocess.Popen[str]:
    """Another process holding `data_dir` (as another server would), once it says so."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(data_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_second_server_on_one_data_folder_is_refused_naming_the_first(tmp_path: Path) -> None:
    first = holder(tmp_path / "data")
    try:
        with pytest.raises(ConfigError) as refused:
            hold_data_dir(tmp_path / "data", "127.0.0.1:8002", "127.0.0.1:8002")
        message = str(refused.value)
        assert f"pid {first.pid}" in message and "10.0.0.9:8000" in message and "fe-9" in message
        assert "--data-dir" in message
    finally:
        first.kill()
        first.wait()


def test_a_folder_whose_server_was_killed_is_taken_again(tmp_path: Path) -> None:
    first = holder(tmp_path / "data")
    first.kill()  # SIGKILL: no clean-up ran, the kernel dropped the lock
    first.wait()
    held = hold_data_dir(tmp_path / "data", "127.0.0.1:8000", "fe-a")
    try:
        assert held.fd is not None
        assert b'"pid": %d' % os.getpid() in (tmp_path / "data" / LOCK_NAME).read_bytes()
    finally:
        assert held.fd is not None
        os.close(held.fd)


def test_the_folder_is_created_and_one_that_cannot_be_written_is_not_locked(tmp_path: Path) -> None:
    held = hold_data_dir(tmp_path / "new" / "data", "127.0.0.1:8000", "fe-a")
    assert held.fd is not None and (tmp_path / "new" / "data" / LOCK_NAME).is_file()
    os.close(held.fd)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert hold_data_dir(blocked / "data", "127.0.0.1:8000", "fe-a").fd is None
