"""Workers that outlive their owner front end (worker/survivors.py, worker/supervisor.py): how the
workers of one server's address are found, how a pid is recognised as the same worker (not a process
that reused it), and a restarted owner's supervisor adopting the workers its slots match and stopping
the others. The "workers" are real processes that only sleep, named like workers on their command line."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.worker.supervisor import Supervisor
from inferd.worker.survivors import Adopted, Survivor, runs_as, survivors


@pytest.fixture
def address(tmp_path: Path) -> str:
    """A worker address of this test's own (no other test's sleepers are found at it)."""
    return f"unix:{tmp_path / 'workers-0.sock'}"


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def sleeper(started: list[subprocess.Popen[bytes]], address: str, incarnation: str, *more: str) -> int:
    """A process whose command line reads like the worker `incarnation`'s; it sleeps until killed."""
    code = "import time; time.sleep(60)"
    args = ["inferd.worker.main", "--connect", address, "--model", "m", "--worker-id", incarnation, *more]
    proc = subprocess.Popen([sys.executable, "-c", code, *args])
    started.append(proc)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until it has exec'd: its command line is its own
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            if incarnation.encode() in f.read():
                return proc.pid
        time.sleep(0.01)
    raise AssertionError(f"the sleeper {incarnation} did not start within 10 s")


def test_the_workers_of_one_address_are_found_with_their_slots(
    address: str, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    a = sleeper(sleepers, address, "m-0.3")
    b = sleeper(sleepers, address, "my-model.v2-1.0", "--model-version", "2")
    sleeper(sleepers, "unix:/tmp/another-server/workers-0.sock", "m-0.0")
    sleeper(sleepers, address, "not-a-slot-id")
    found = survivors(address)
    assert found == [Survivor("m", 0, None, 3, a), Survivor("my-model.v2", 1, 2, 0, b)]
    assert found[0].incarnation == "m-0.3" and found[1].slot_key == ("my-model.v2", 1, 2)


def test_a_pid_is_the_worker_only_while_it_runs_under_that_name(
    address: str, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    pid = sleeper(sleepers, address, "m-0.3")
    assert runs_as(pid, "m-0.3", address)
    assert not runs_as(pid, "m-0.4", address)  # a later incarnation of the slot
    assert not runs_as(pid, "m-0.3", "unix:/tmp/another-server/workers-0.sock")
    adopted = Adopted(pid, "m-0.3", address)
    assert adopted.returncode is None
    adopted.kill()
    sleepers[0].wait()  # a zombie until then: not running either way
    assert adopted.returncode == -1 and not runs_as(pid, "m-0.3", address)


async def test_a_restarted_owner_adopts_its_slots_workers_and_the_added_ones_and_stops_the_others(
    address: str, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    kept = sleeper(sleepers, address, "m-0.3")
    scaled = sleeper(sleepers, address, "m-5.1")  # a slot the previous owner's autoscaler added
    older = sleeper(sleepers, address, "m-0.2")  # an earlier incarnation still exiting
    update = sleeper(sleepers, address, "m-3.0", "--model-version", "2")  # a version not run here
    zero = sleeper(sleepers, address, "z-0.4")  # a model configured with workers = 0, scaled up since
    supervisor = Supervisor(address, "token", "INFO", adopt=True)
    (slot,) = supervisor.add("m", 1)
    assert supervisor.add("z", 0) == []
    running = asyncio.create_task(supervisor.run())
    try:
        async with asyncio.timeout(10):
            while any(s.process is None for s in supervisor.slots):  # noqa: ASYNC110 - its tasks set them
                await asyncio.sleep(0.01)
            codes = [await asyncio.to_thread(p.wait) for p in sleepers[2:4]]
        assert isinstance(slot.process, Adopted) and slot.process.pid == kept
        assert slot.incarnation == "m-0.3"  # the adopted worker's id, so the hub and watchdog match it
        added = {s.incarnation: s for s in supervisor.slots[1:]}  # the scaled-up slots are back, with workers
        assert sorted(added) == ["m-5.1", "z-0.4"] and all(
            isinstance(s.process, Adopted) for s in added.values()
        )
        assert sorted(supervisor.pids()) == sorted([kept, scaled, zero])
        assert [s.index for s in supervisor.slots if s.model == "m"] == [0, 5]  # a scale-up takes 6 (`add`)
        assert codes == [-15, -15], (older, update)  # SIGTERM
    finally:
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
    assert await asyncio.to_thread(sleepers[0].wait, 10) == -15  # stopped with the supervisor
    assert await asyncio.to_thread(sleepers[1].wait, 10) == -15
    assert await asyncio.to_thread(sleepers[4].wait, 10) == -15


def test_a_worker_that_cannot_be_signalled_is_logged_not_raised(
    address: str,
    sleepers: list[subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another user's process (EPERM) must not abort the supervisor that adopts or stops it."""
    pid = sleeper(sleepers, address, "m-0.3")
    caplog.set_level(logging.WARNING, logger="inferd")  # whatever an earlier test left the level at

    def refuse(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", refuse)
    adopted = Adopted(pid, "m-0.3", address)
    adopted.terminate()
    adopted.kill()
    assert "cannot signal worker m-0.3" in caplog.text
    assert adopted.returncode is None  # still running: nothing was sent
