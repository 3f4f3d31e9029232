"""Runs the local worker processes (children of `inferd serve`) and restarts those that exit.

The slots, the bootstrap (`python -m inferd.worker.main ...`) and the restart loop with its backoff are
worker.launcher's, shared with the Ray launcher; this module only starts, awaits and stops child processes.
With a `record` (several front ends: worker/survivors.py), it also adopts the workers a previous owner
left running instead of starting new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from inferd.worker.launcher import Launcher, WorkerBootstrap, WorkerExit, WorkerSlot, describe_exit
from inferd.worker.survivors import Adopted, Survivor, WorkerRecord, runs_as

log = logging.getLogger("inferd.supervisor")

__all__ = ["Supervisor", "WorkerSlot"]

ADOPTED_POLL_S = 0.2
"""How often an adopted worker (not a child: no wait) is looked at."""

LocalProcess = asyncio.subprocess.Process | Adopted


class Supervisor(Launcher[LocalProcess]):
    """Workers as child processes of the server, one per slot."""

    def __init__(
        self,
        address: str,
        token: str,
        log_level: str,
        *,
        record: WorkerRecord | None = None,
        **options: Any,
    ) -> None:
        super().__init__(address, token, log_level, **options)
        self.record = record
        """Where this supervisor's workers are written down for the next owner; None: one front end."""
        self._survivors = {s.slot_key: s for s in record.read()} if record is not None else {}
        """What the previous owner left (read once): adopted by the slots that match, else stopped."""

    async def run(self) -> None:
        self._stop_strays()
        await super().run()

    async def _start(self, slot: WorkerSlot, bootstrap: WorkerBootstrap) -> LocalProcess:
        survivor = self._survivors.pop((slot.model, slot.index, slot.version), None)
        process: LocalProcess
        if survivor is not None and runs_as(survivor.pid, survivor.incarnation, bootstrap.address):
            slot.restarts = survivor.restarts
            process = Adopted(survivor.pid, slot.incarnation, bootstrap.address)
            log.info("adopted worker %s (pid %d) left by the previous owner", slot.incarnation, process.pid)
        else:
            process = await asyncio.create_subprocess_exec(
                *bootstrap.command(slot), stdin=asyncio.subprocess.DEVNULL, env=bootstrap.environment()
            )
            log.info("started worker %s (pid %d)", slot.worker_id, process.pid)
        slot.process = process
        self._write_record()
        return process

    async def _wait(self, slot: WorkerSlot, process: LocalProcess) -> WorkerExit:
        if isinstance(process, Adopted):
            while process.returncode is None:  # noqa: ASYNC110 - not a child: nothing to wait on
                await asyncio.sleep(ADOPTED_POLL_S)
            return WorkerExit(-1, "exit (adopted: its code went to the parent)")
        code = await process.wait()
        return WorkerExit(code, describe_exit(code))

    async def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every worker (they drain and exit), SIGKILL those still there after `grace_s`."""
        self._stopping = True
        procs = [s.process for s in self.slots if s.process is not None and s.process.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in procs:
            try:
                async with asyncio.timeout(grace_s):
                    await self._gone(proc)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await self._gone(proc)

    async def _gone(self, proc: object) -> None:
        if isinstance(proc, asyncio.subprocess.Process):
            await proc.wait()
            return
        while isinstance(proc, Adopted) and proc.returncode is None:  # noqa: ASYNC110
            await asyncio.sleep(ADOPTED_POLL_S / 4)

    def _write_record(self) -> None:
        if self.record is None:
            return
        workers = [
            Survivor(s.model, s.index, s.version, s.restarts, s.process.pid)
            for s in self.slots
            if s.process is not None and s.process.pid
        ]
        try:
            self.record.write(workers)
        except OSError as exc:
            log.warning(
                "cannot record the workers in %s: %s (a restarted owner starts new ones)",
                self.record.path,
                exc,
            )

    def _stop_strays(self) -> None:
        """The previous owner's workers that no slot of this one takes (their slot is gone): SIGTERM."""
        slots = {(s.model, s.index, s.version) for s in self.slots}
        for key, survivor in list(self._survivors.items()):
            if key in slots or not runs_as(survivor.pid, survivor.incarnation, self.address):
                continue
            del self._survivors[key]
            log.info(
                "stopping worker %s (pid %d): no slot of this owner takes it",
                survivor.incarnation,
                survivor.pid,
            )
            Adopted(survivor.pid, survivor.incarnation, self.address).terminate()
