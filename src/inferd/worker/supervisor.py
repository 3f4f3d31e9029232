"""Runs the local worker processes (children of `inferd serve`) and restarts those that exit.

Restarts back off exponentially (capped); the backoff resets once a restarted worker has done healthy
work (completed a batch, or ran for healthy_after_s), so a kill every few seconds is recovered from at
once while a true crash loop (dying while loading, or before finishing any batch) is not retried in a storm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.worker.connection import slot_of

log = logging.getLogger("inferd.supervisor")


@dataclass
class WorkerSlot:
    model: str
    index: int
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    consecutive_failures: int = 0
    did_work: bool = False
    """Whether the current process completed a batch (then its death is no crash loop: backoff resets)."""
    retired: bool = False
    """Set when the slot is being removed (scale-down, rolling update): its process is not restarted."""
    exit_codes: list[int] = field(default_factory=list)

    @property
    def worker_id(self) -> str:
        return f"{self.model}-{self.index}"


class Supervisor:
    def __init__(
        self,
        address: str,
        token: str,
        log_level: str,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 30.0,
        healthy_after_s: float = 10.0,
    ) -> None:
        self.address = address
        self.token = token
        self.log_level = log_level
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.healthy_after_s = healthy_after_s
        self.slots: list[WorkerSlot] = []
        self._stopping = False
        self.restart_hooks: list[Callable[[WorkerSlot], None]] = []
        self._tg: asyncio.TaskGroup | None = None

    def add(self, model: str, count: int) -> list[WorkerSlot]:
        """New slots for a model; started at once when the supervisor already runs (scale-up)."""
        first = max((s.index + 1 for s in self.slots if s.model == model), default=0)
        new = [WorkerSlot(model, first + i) for i in range(count)]
        self.slots.extend(new)
        if self._tg is not None:
            for slot in new:
                self._tg.create_task(self._keep_running(slot))
        return new

    def retire(self, slot: WorkerSlot) -> None:
        """Do not restart this slot's process once it exits (it is being drained away)."""
        slot.retired = True

    def live_slots(self, model: str) -> list[WorkerSlot]:
        return [s for s in self.slots if s.model == model and not s.retired]

    async def run(self) -> None:
        """Keep every slot's process running until cancelled; then stop them all."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for slot in self.slots:
                    tg.create_task(self._keep_running(slot))
                await asyncio.Event().wait()  # slots come and go; run until cancelled
        finally:
            self._tg = None
            await self.stop_all()

    async def _keep_running(self, slot: WorkerSlot) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping and not slot.retired:
            started = loop.time()
            slot.did_work = False
            slot.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "inferd.worker.main",
                "--connect",
                self.address,
                "--model",
                slot.model,
                "--worker-id",
                f"{slot.worker_id}.{slot.restarts}",
                "--token",
                self.token,
                "--log-level",
                self.log_level,
                stdin=asyncio.subprocess.DEVNULL,
            )
            log.info("started worker %s (pid %d)", slot.worker_id, slot.process.pid)
            code = await slot.process.wait()
            if self._stopping:
                return
            if slot.retired:
                log.info(
                    "worker %s (pid %d) retired with %s", slot.worker_id, slot.process.pid, _describe(code)
                )
                self.slots.remove(slot)
                return
            ran_s = loop.time() - started
            delay = self._record_exit(slot, code, ran_s)
            log.warning(
                "worker %s (pid %d) exited with %s after %.1fs; restarting in %.2fs",
                slot.worker_id,
                slot.process.pid,
                _describe(code),
                ran_s,
                delay,
            )
            await asyncio.sleep(delay)

    def _record_exit(self, slot: WorkerSlot, code: int, ran_s: float) -> float:
        """Count a worker's death and return the delay before its restart: the backoff grows only while
        it keeps dying without doing healthy work (a crash loop), and resets otherwise."""
        slot.exit_codes.append(code)
        healthy = slot.did_work or ran_s >= self.healthy_after_s
        slot.consecutive_failures = 0 if healthy else slot.consecutive_failures + 1
        slot.restarts += 1
        for hook in self.restart_hooks:
            hook(slot)
        return self._backoff(slot.consecutive_failures)

    def _backoff(self, failures: int) -> float:
        if failures <= 0:
            return self.backoff_initial_s
        return min(self.backoff_max_s, self.backoff_initial_s * 2**failures)

    def mark_healthy(self, worker_id: str) -> None:
        """The worker with this id completed work: a later death is not part of a crash loop."""
        for slot in self.slots:
            if slot_of(worker_id) == slot.worker_id:
                slot.did_work = True

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.slots if s.process is not None and s.process.returncode is None]

    async def stop_all(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        procs = [s.process for s in self.slots if s.process is not None and s.process.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                async with asyncio.timeout(grace_s):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
