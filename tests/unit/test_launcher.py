"""The restart loop and bootstrap every launcher shares (worker.launcher), driven through a launcher whose
workers are scripted: each start is reported, each exit is sent by the test (with how long the worker
ran, on a fake clock). No processes, no Ray.

Behaviour: a worker starts with the bootstrap's arguments (its version as --model-version when the slot
has one); a crash loop backs off exponentially and a worker that did healthy work restarts at the first
delay; restarts run the hooks; a retired slot is not restarted and leaves; live_slots filters by version.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

import pytest

from inferd.clock import FakeClock
from inferd.routing.backoff import Backoff
from inferd.worker.launcher import Launcher, WorkerBootstrap, WorkerExit, WorkerSlot
from inferd.worker.supervisor import Supervisor

STEP_S = 0.001
"""The scripted launcher's first restart delay: real, but far below anything a test waits for."""


@dataclass
class ScriptedProcess:
    pid: int
    args: list[str]
    returncode: int | None = None
    killed: bool = False

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        self.killed = True


class ScriptedLauncher(Launcher[ScriptedProcess]):
    def __init__(self, clock: FakeClock) -> None:
        super().__init__("unix:/tmp/w.sock", "tok", "DEBUG", backoff=Backoff(STEP_S, 8 * STEP_S), clock=clock)
        self.fake_clock = clock
        self.started: asyncio.Queue[ScriptedProcess] = asyncio.Queue()
        self.ended: asyncio.Queue[WorkerSlot] = asyncio.Queue()
        """Slots whose restart loop is over (retired, or the launcher stopped)."""
        self.exits: dict[int, asyncio.Queue[tuple[int, float]]] = {}
        self.next_pid = 100

    async def _start(self, slot: WorkerSlot, bootstrap: WorkerBootstrap) -> ScriptedProcess:
        self.next_pid += 1
        process = ScriptedProcess(self.next_pid, bootstrap.args(slot))
        self.exits[process.pid] = asyncio.Queue()
        self.started.put_nowait(process)
        return process

    async def _keep_running(self, slot: WorkerSlot) -> None:
        await super()._keep_running(slot)
        self.ended.put_nowait(slot)

    async def _wait(self, slot: WorkerSlot, process: ScriptedProcess) -> WorkerExit:
        code, ran_s = await self.exits[process.pid].get()
        self.fake_clock.advance(ran_s)
        process.returncode = code
        return WorkerExit(code, f"code {code}")

    async def stop_all(self, grace_s: float = 5.0) -> None:
        self._stopping = True

    def exit(self, process: ScriptedProcess, code: int, ran_s: float) -> None:
        self.exits[process.pid].put_nowait((code, ran_s))

    async def next_start(self) -> ScriptedProcess:
        async with asyncio.timeout(10):
            return await self.started.get()


def arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


async def test_restart_loop_backs_off_on_a_crash_loop_and_resets_after_healthy_work() -> None:
    launcher = ScriptedLauncher(FakeClock())
    restarted: list[tuple[str, int]] = []
    launcher.restart_hooks.append(lambda slot: restarted.append((slot.worker_id, slot.restarts)))
    (slot,) = launcher.add("sim", 1)
    async with asyncio.TaskGroup() as tg:
        runner = tg.create_task(launcher.run())
        first = await launcher.next_start()
        assert arg(first.args, "--worker-id") == "sim-0.0" and "--model-version" not in first.args
        failures = []
        process = first
        for _ in range(3):  # dies while loading, again and again: a crash loop
            launcher.exit(process, 1, 0.5)
            process = await launcher.next_start()
            failures.append(slot.consecutive_failures)
        assert failures == [1, 2, 3] and slot.exit_codes == [1, 1, 1]
        assert arg(process.args, "--worker-id") == "sim-0.3"
        launcher.mark_healthy("sim-0.2")  # a late report of an earlier incarnation proves nothing
        assert not slot.did_work
        launcher.mark_healthy("sim-0.3")  # this one completed a batch before it died
        launcher.exit(process, -9, 0.5)
        process = await launcher.next_start()
        assert slot.consecutive_failures == 0 and restarted[-1] == ("sim-0", 4)
        launcher.exit(process, 1, 60.0)  # ran long enough to count as healthy on its own
        await launcher.next_start()
        assert slot.consecutive_failures == 0 and len(restarted) == 5
        assert slot.process is not None and launcher.pids() == [slot.process.pid]
        runner.cancel()
    assert launcher.slots == [slot]


def test_restart_delay_is_the_shared_backoff_of_the_crash_count() -> None:
    launcher = ScriptedLauncher(FakeClock())
    (slot,) = launcher.add("sim", 1)
    delays = [launcher.record_exit(slot, 1, 0.1) for _ in range(6)]
    assert delays == pytest.approx([2 * STEP_S, 4 * STEP_S, 8 * STEP_S, 8 * STEP_S, 8 * STEP_S, 8 * STEP_S])
    slot.did_work = True
    assert launcher.record_exit(slot, 1, 0.1) == STEP_S and slot.restarts == 7
    assert Supervisor("unix:/x", "t", "INFO").record_exit(WorkerSlot("m", 0), 1, 0.0) == pytest.approx(0.2)


async def test_a_retired_slot_is_not_restarted_and_leaves() -> None:
    launcher = ScriptedLauncher(FakeClock())
    launcher.add("sim", 1)
    async with asyncio.TaskGroup() as tg:
        runner = tg.create_task(launcher.run())
        await launcher.next_start()
        old, new = launcher.add("sim", 2, version=3)  # scale-up while running, at version 3
        starts = [await launcher.next_start(), await launcher.next_start()]
        assert sorted(arg(p.args, "--worker-id") or "" for p in starts) == ["sim-1.0", "sim-2.0"]
        assert all(arg(p.args, "--model-version") == "3" for p in starts)
        assert [s.worker_id for s in launcher.live_slots("sim", version=3)] == ["sim-1", "sim-2"]
        assert len(launcher.live_slots("sim")) == 3 and launcher.live_slots("sim", version=2) == []
        launcher.retire(old)
        assert [s.worker_id for s in launcher.live_slots("sim", version=3)] == ["sim-2"]
        assert old.process is not None
        launcher.exit(old.process, 0, 1.0)  # type: ignore[arg-type]
        async with asyncio.timeout(10):
            assert await launcher.ended.get() is old
        assert old not in launcher.slots and old.restarts == 0 and launcher.started.empty()
        assert not launcher.kill("sim-2.7")  # no such incarnation: nothing is killed
        assert launcher.kill("sim-2.0") and new.process is not None and new.process.killed  # type: ignore[union-attr]
        runner.cancel()


def test_every_worker_starts_from_one_bootstrap() -> None:
    boot = WorkerBootstrap("127.0.0.1:7000", "secret", "INFO", {"INFERD_SIM_SLOWDOWN": "3"})
    slot = WorkerSlot("llm", 4, version=2, restarts=5)
    assert boot.args(slot) == [
        *("--connect", "127.0.0.1:7000", "--model", "llm", "--worker-id", "llm-4.5"),
        *("--token", "secret", "--log-level", "INFO", "--model-version", "2"),
    ]
    assert boot.command(slot) == [sys.executable, "-m", "inferd.worker.main", *boot.args(slot)]
    env = boot.environment()
    assert env is not None and env["INFERD_SIM_SLOWDOWN"] == "3" and "PATH" in env
    assert WorkerBootstrap("a", "t", "INFO").environment() is None  # inherits the server's as it is


def test_a_pool_workers_slot_starts_it_with_its_pool() -> None:
    launcher = ScriptedLauncher(FakeClock())
    slots = launcher.add_pool("gpu", 2)
    assert [s.worker_id for s in slots] == ["pool:gpu-0", "pool:gpu-1"]
    args = WorkerBootstrap("unix:/w.sock", "tok", "INFO").args(slots[1])
    assert args[:6] == ["--connect", "unix:/w.sock", "--pool", "gpu", "--worker-id", "pool:gpu-1.0"]
    assert "--model" not in args


async def test_a_worker_joins_the_front_ends_its_launcher_names_at_each_start() -> None:
    """`Launcher.connect` is asked at every start (the front ends of a shared store: this one's address
    and every other live one's, cluster/frontend.py `worker_addresses`): a restarted worker, or a
    rolling update's new one, joins the front ends live then."""
    launcher = ScriptedLauncher(FakeClock())
    fronts = ["unix:/tmp/w.sock", "10.0.0.2:9000"]
    launcher.connect = lambda: ",".join(fronts)
    launcher.add("sim", 1)
    async with asyncio.TaskGroup() as tg:
        runner = tg.create_task(launcher.run())
        first = await launcher.next_start()
        assert arg(first.args, "--connect") == "unix:/tmp/w.sock,10.0.0.2:9000"
        fronts.append("10.0.0.3:9000")  # a front end joined meanwhile
        launcher.exit(first, 1, 0.5)
        again = await launcher.next_start()
        assert arg(again.args, "--connect") == "unix:/tmp/w.sock,10.0.0.2:9000,10.0.0.3:9000"
        runner.cancel()
    launcher.connect = None
    assert launcher.bootstrap().address == "unix:/tmp/w.sock"  # none: the launcher's own address
    launcher.token = ""  # the join token, in the workers' environment: no --token on their command line
    assert "--token" not in launcher.bootstrap().args(WorkerSlot("sim", 0))


def test_a_prefix_names_the_launchers_slots_where_workers_of_several_meet() -> None:
    """Local workers of several front ends joining the same front ends: each front end's ids differ."""
    launcher = ScriptedLauncher(FakeClock())
    (plain,) = launcher.add("sim", 1)
    launcher.prefix = "fe-a:"
    (named,) = launcher.add("sim", 1, version=2)
    assert plain.worker_id == "sim-0" and named.worker_id == "fe-a:sim-1"
    assert arg(launcher.bootstrap().args(named), "--worker-id") == "fe-a:sim-1.0"
    assert launcher.live_slots("sim", 2) == [named]
