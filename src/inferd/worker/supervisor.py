"""Runs the local worker processes (children of `inferd serve`) and restarts those that exit.

The slots, the bootstrap (`python -m inferd.worker.main ...`) and the restart loop with its backoff are
worker.launcher's, shared with the Ray launcher; this module only starts, awaits and stops child processes.
With `adopt` (several front ends: worker/survivors.py), it first adopts the workers a previous owner
left running instead of starting new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from inferd.worker.launcher import Launcher, WorkerBootstrap, WorkerExit, WorkerSlot, describe_exit
from inferd.worker.survivors import Adopted, Survivor, runs_as, survivors

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
        adopt: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(address, token, log_level, **options)
        self.adopt = adopt
        """Adopt the workers a previous owner left at this address (several front ends)."""
        self._survivors: dict[tuple[str, int, int | None], Survivor] = {}
        """What the previous owner left, found once at `run`: adopted by the slots that match."""

    async def run(self) -> None:
        if self.adopt:
            self._find_survivors()
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

    def _find_survivors(self) -> None:
        """The previous owner's workers: the newest of each slot's is kept for adoption. A slot the
        previous owner added (its autoscaler scaled up since the config) is added back and keeps its
        worker, if this owner serves that model at that version: capacity survives the owner's restart,
        and the autoscaler, which counts the live slots, scales from there. The others (older
        incarnations, a model or version this owner does not run, e.g. a rolling update's) get SIGTERM."""
        slots = {(s.model, s.index, s.version) for s in self.slots}
        for survivor in survivors(self.address):
            key = survivor.slot_key
            if key not in self._survivors and (
                key in slots or (survivor.model, survivor.version) in self.served
            ):
                if key not in slots:
                    self.slots.append(WorkerSlot(survivor.model, survivor.index, survivor.version))
                    slots.add(key)
                    log.info("keeping slot %s-%d the previous owner added", survivor.model, survivor.index)
                self._survivors[key] = survivor
                continue
            log.info(
                "stopping worker %s (pid %d): no slot of this owner takes it",
                survivor.incarnation,
                survivor.pid,
            )
            Adopted(survivor.pid, survivor.incarnation, self.address).terminate()
