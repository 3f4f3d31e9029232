"""Runs the local worker processes (children of `inferd serve`) and restarts those that exit.

The slots, the bootstrap (`python -m inferd.worker.main ...`) and the restart loop with its backoff are
worker.launcher's, shared with the Ray launcher; this module only starts, awaits and stops child processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from inferd.worker.launcher import Launcher, WorkerBootstrap, WorkerExit, WorkerSlot, describe_exit

log = logging.getLogger("inferd.supervisor")

__all__ = ["Supervisor", "WorkerSlot"]


class Supervisor(Launcher[asyncio.subprocess.Process]):
    """Workers as child processes of the server, one per slot."""

    async def _start(self, slot: WorkerSlot, bootstrap: WorkerBootstrap) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            *bootstrap.command(slot), stdin=asyncio.subprocess.DEVNULL, env=bootstrap.environment()
        )
        log.info("started worker %s (pid %d)", slot.worker_id, process.pid)
        return process

    async def _wait(self, slot: WorkerSlot, process: asyncio.subprocess.Process) -> WorkerExit:
        code = await process.wait()
        return WorkerExit(code, describe_exit(code))

    async def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child (workers drain and exit), SIGKILL those still there after `grace_s`."""
        self._stopping = True
        procs = [
            s.process
            for s in self.slots
            if isinstance(s.process, asyncio.subprocess.Process) and s.process.returncode is None
        ]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in procs:
            try:
                async with asyncio.timeout(grace_s):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
