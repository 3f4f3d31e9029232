"""Workers that outlive their owner front end (worker/survivors.py, worker/supervisor.py): the record
the owner keeps, how a recorded pid is recognised as the same worker (not a process that reused its
pid), and a restarted owner's supervisor adopting the workers its slots match and stopping the others.
The "workers" are real processes that only sleep, named like workers on their command line."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferd.worker.supervisor import Supervisor
from inferd.worker.survivors import Adopted, Survivor, WorkerRecord, runs_as

ADDRESS = "unix:/tmp/inferd-test/workers-0.sock"


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def sleeper(started: list[subprocess.Popen[bytes]], incarnation: str, address: str = ADDRESS) -> int:
    """A process whose command line reads like the worker `incarnation`'s; it sleeps until killed."""
    code = "import time; time.sleep(60)"
    args = ["inferd.worker.main", "--connect", address, "--model", "m", "--worker-id", incarnation]
    proc = subprocess.Popen([sys.executable, "-c", code, *args])
    started.append(proc)
    return proc.pid


def test_the_record_keeps_each_worker_and_a_torn_one_reads_as_none(tmp_path: Path) -> None:
    record = WorkerRecord(str(tmp_path / "workers.json"))
    assert record.read() == []
    workers = [Survivor("m", 0, None, 3, 101), Survivor("m", 1, 2, 0, 102)]
    record.write(workers)
    assert record.read() == workers
    assert workers[0].incarnation == "m-0.3"
    (tmp_path / "workers.json").write_text('[{"model": "m"')
    assert record.read() == []


def test_a_recorded_pid_is_the_worker_only_while_it_runs_under_that_name(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    pid = sleeper(sleepers, "m-0.3")
    assert runs_as(pid, "m-0.3", ADDRESS)
    assert not runs_as(pid, "m-0.4", ADDRESS)  # a later incarnation of the slot
    assert not runs_as(pid, "m-0.3", "unix:/tmp/another-server/workers-0.sock")
    adopted = Adopted(pid, "m-0.3", ADDRESS)
    assert adopted.returncode is None
    adopted.kill()
    sleepers[0].wait()
    assert adopted.returncode == -1 and not runs_as(pid, "m-0.3", ADDRESS)


async def test_a_restarted_owner_adopts_its_slots_workers_and_stops_the_others(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    kept, stray = sleeper(sleepers, "m-0.3"), sleeper(sleepers, "m-5.0")
    record = WorkerRecord(str(tmp_path / "workers.json"))
    record.write([Survivor("m", 0, None, 3, kept), Survivor("m", 5, None, 0, stray)])
    supervisor = Supervisor(ADDRESS, "token", "INFO", record=record)
    (slot,) = supervisor.add("m", 1)
    running = asyncio.create_task(supervisor.run())
    try:
        async with asyncio.timeout(10):
            while slot.process is None:  # noqa: ASYNC110 - the supervisor's task sets it
                await asyncio.sleep(0.01)
            stray_code = await asyncio.to_thread(sleepers[1].wait)
        assert isinstance(slot.process, Adopted) and slot.process.pid == kept
        assert slot.incarnation == "m-0.3"  # the adopted worker's id, so the hub and watchdog match it
        assert supervisor.pids() == [kept]
        assert stray_code == -15  # its slot is gone: SIGTERM
        assert record.read() == [Survivor("m", 0, None, 3, kept)]  # for the owner after this one
    finally:
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
    assert await asyncio.to_thread(sleepers[0].wait, 10) == -15  # stopped with the supervisor
