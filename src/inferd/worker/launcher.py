"""What every worker launcher shares (local child processes: worker.supervisor; Ray actors:
fleet.ray_launcher): the slot a worker runs in, the bootstrap it starts with, and the restart loop that
keeps it running.

* **Slots.** A slot is one place for a worker of one model, at one version (`version` None: the model's
  default). Its worker registers as `MODEL-INDEX.RESTARTS`; scale-down and rolling updates `retire` a
  slot: its worker is not restarted, and the slot goes once the worker has exited.
* **Bootstrap.** Every worker runs `inferd.worker.main` with the same arguments wherever it runs
  (`WorkerBootstrap.args`): a local one as a child process (`command`), a Ray one by calling that main in
  its actor. `env` is added to the environment the worker would otherwise inherit (the server's for a
  child process, its node's for an actor).
* **Restart loop.** A worker that exits is started again after a capped exponential backoff
  (routing.backoff). The backoff resets once a restarted worker has done healthy work (completed a
  batch, or ran for `healthy_after_s`), so a kill every few seconds is recovered from at once while a true
  crash loop (dying while loading, or before finishing any batch) is not retried in a storm. Each restart
  runs the `restart_hooks`.

How a worker is started, awaited and stopped is each launcher's own: `_start`, `_wait` and `stop_all`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from inferd.clock import Clock, MonotonicClock
from inferd.routing.backoff import Backoff

log = logging.getLogger("inferd.supervisor")

RESTART_BACKOFF = Backoff(0.1, 30.0)
"""0.1 s, doubling with each crash in a row, up to 30 s."""


class WorkerProcess(Protocol):
    """A running worker as a launcher holds it: a child process, or a Ray actor."""

    @property
    def pid(self) -> int:
        """Its process id (on its own host; 0 while not known yet)."""
        ...

    @property
    def returncode(self) -> int | None:
        """None while it runs."""
        ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@dataclass
class WorkerSlot:
    model: str
    index: int
    version: int | None = None
    """The model version its worker serves; None: the model's default."""
    process: WorkerProcess | None = None
    restarts: int = 0
    consecutive_failures: int = 0
    """Deaths in a row without healthy work between: the restart backoff's step."""
    did_work: bool = False
    """Whether the current process completed a batch (then its death is no crash loop: backoff resets)."""
    retired: bool = False
    """Set when the slot is being removed (scale-down, rolling update): its process is not restarted."""
    exit_codes: list[int] = field(default_factory=list)
    prefix: str = ""
    """Before its id, where workers of several launchers meet (`Launcher.prefix`)."""
    pool: str | None = None
    """A pool worker's slot (`model` is then `pool:NAME`): its worker loads the pool's models on demand."""

    @property
    def worker_id(self) -> str:
        return f"{self.prefix}{self.model}-{self.index}"

    @property
    def incarnation(self) -> str:
        """The id its current worker registers with: `MODEL-INDEX.RESTARTS` (after the prefix)."""
        return f"{self.worker_id}.{self.restarts}"


@dataclass(frozen=True, slots=True)
class WorkerExit:
    code: int
    """The exit code (negative: killed by that signal)."""
    how: str
    """In words, for the log: "code 1", "signal SIGKILL", "actor death (RayActorError)"."""


@dataclass(frozen=True)
class WorkerBootstrap:
    """How every worker starts, whichever launcher runs it."""

    address: str
    """The front end's worker address the worker connects to."""
    token: str
    log_level: str
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables added to the environment the worker inherits."""
    extra_args: tuple[str, ...] = ()
    """More arguments (the log format and trace export: ObservabilitySettings.worker_args)."""

    def args(self, slot: WorkerSlot) -> list[str]:
        """`inferd.worker.main`'s arguments for the slot's next worker."""
        args = [
            *("--connect", self.address),
            *(("--pool", slot.pool) if slot.pool is not None else ("--model", slot.model)),
            *("--worker-id", slot.incarnation),
            *(("--token", self.token) if self.token else ()),  # "": the environment's INFERD_JOIN_TOKEN
            *("--log-level", self.log_level),
        ]
        if slot.version is not None:
            args += ["--model-version", str(slot.version)]
        return args + list(self.extra_args)

    def command(self, slot: WorkerSlot) -> list[str]:
        """The command line of a local worker process."""
        return [sys.executable, "-m", "inferd.worker.main", *self.args(slot)]

    def environment(self) -> dict[str, str] | None:
        """A local worker process's environment: None inherits the server's unchanged."""
        return {**os.environ, **self.env} if self.env else None


P = TypeVar("P", bound=WorkerProcess)


class Launcher(abc.ABC, Generic[P]):
    """The slots and the restart loop; `P` is what the launcher runs a worker as."""

    def __init__(
        self,
        address: str,
        token: str,
        log_level: str,
        *,
        env: Mapping[str, str] | None = None,
        backoff: Backoff = RESTART_BACKOFF,
        healthy_after_s: float = 10.0,
        clock: Clock | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.address = address
        """Where workers connect; settable until `run` (the server learns its TCP port late)."""
        self.connect: Callable[[], str] | None = None
        """Where workers connect, asked again at each worker start (None: `address`): the front ends of
        a shared store give this front end's address and every other live one's, so its local workers
        join every front end (cluster/frontend.py `join_every_front_end`)."""
        self.prefix = ""
        """Before the id of every slot added from now on: where local workers of several front ends
        join the same front ends, each front end's name, so their ids differ (`FRONTEND:MODEL-INDEX`)."""
        self.token = token
        self.log_level = log_level
        self.env = dict(env or {})
        self.extra_args = tuple(extra_args)
        self.backoff = backoff
        self.healthy_after_s = healthy_after_s
        self.clock = clock or MonotonicClock()
        self.slots: list[WorkerSlot] = []
        self.served: set[tuple[str, int | None]] = set()
        """Every (model, version) ever given slots here, even none (`workers = 0`, scaled up later)."""
        self.restart_hooks: list[Callable[[WorkerSlot], None]] = []
        self._stopping = False
        self._tg: asyncio.TaskGroup | None = None

    # ---- the slots -----------------------------------------------------------------------------------
    def add(self, model: str, count: int, version: int | None = None) -> list[WorkerSlot]:
        """New slots for a model (at `version`; None: its default); started at once when the launcher
        already runs (scale-up)."""
        self.served.add((model, version))
        first = max((s.index + 1 for s in self.slots if s.model == model), default=0)
        new = [WorkerSlot(model, first + i, version, prefix=self.prefix) for i in range(count)]
        self.slots.extend(new)
        if self._tg is not None:
            for slot in new:
                self._tg.create_task(self._keep_running(slot))
        return new

    def add_pool(self, pool: str, count: int) -> list[WorkerSlot]:
        """Slots of pool workers (`[pools.NAME] workers`): ids `pool:NAME-INDEX`; before the launcher runs."""
        new = [WorkerSlot(f"pool:{pool}", i, prefix=self.prefix, pool=pool) for i in range(count)]
        self.slots.extend(new)
        return new

    def add_at(self, model: str, version: int, indexes: list[int]) -> list[WorkerSlot]:
        """Slots at these indexes (a restarted owner takes back its predecessor's: cluster/saved.py;
        each adopts that slot's surviving worker, else starts one). Before the launcher runs."""
        if self._tg is not None:
            raise RuntimeError("add_at is for slots taken back before the launcher runs")
        self.served.add((model, version))
        taken = {s.index for s in self.slots if s.model == model}
        new = [WorkerSlot(model, i, version, prefix=self.prefix) for i in sorted(set(indexes) - taken)]
        self.slots.extend(new)
        return new

    def retire(self, slot: WorkerSlot) -> None:
        """Do not restart this slot's process once it exits (it is being drained away)."""
        slot.retired = True

    def live_slots(self, model: str, version: int | None = None) -> list[WorkerSlot]:
        """The model's slots not retired; only those of `version` when it is given."""
        return [
            s
            for s in self.slots
            if s.model == model and not s.retired and (version is None or s.version == version)
        ]

    def mark_healthy(self, worker_id: str) -> None:
        """The worker with this id completed work: a later death is not part of a crash loop."""
        for slot in self.slots:
            if worker_id == slot.incarnation:
                slot.did_work = True

    def pids(self) -> list[int]:
        """Process ids of the running workers (those known yet)."""
        return [
            s.process.pid
            for s in self.slots
            if s.process is not None and s.process.returncode is None and s.process.pid
        ]

    def kill(self, worker_id: str) -> bool:
        """Kill the process running this worker (the hang watchdog's and a forced restart's tool); not
        its successor when the worker is already gone."""
        for slot in self.slots:
            if worker_id == slot.incarnation and slot.process is not None:
                slot.process.kill()
                return True
        return False

    # ---- the restart loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Keep every slot's worker running until cancelled; then stop them all."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for slot in self.slots:
                    tg.create_task(self._keep_running(slot))
                await asyncio.Event().wait()  # slots come and go; run until cancelled
        finally:
            self._tg = None
            await self.stop_all()

    def bootstrap(self) -> WorkerBootstrap:
        address = self.address if self.connect is None else self.connect()
        return WorkerBootstrap(address, self.token, self.log_level, self.env, self.extra_args)

    async def _keep_running(self, slot: WorkerSlot) -> None:
        while not self._stopping and not slot.retired:
            started = self.clock.now()
            slot.did_work = False
            slot.process = process = await self._start(slot, self.bootstrap())
            end = await self._wait(slot, process)
            if self._stopping:
                return
            if slot.retired:
                log.info("worker %s (pid %d) retired with %s", slot.worker_id, process.pid, end.how)
                with contextlib.suppress(ValueError):
                    self.slots.remove(slot)
                return
            ran_s = self.clock.now() - started
            delay_s = self.record_exit(slot, end.code, ran_s)
            log.warning(
                "worker %s (pid %d) exited with %s after %.1fs; restarting in %.2fs",
                slot.worker_id,
                process.pid,
                end.how,
                ran_s,
                delay_s,
            )
            await asyncio.sleep(delay_s)

    def record_exit(self, slot: WorkerSlot, code: int, ran_s: float) -> float:
        """Count a worker's death, run the restart hooks, and return the delay before its restart: the
        backoff grows only while it keeps dying without doing healthy work (a crash loop)."""
        slot.exit_codes.append(code)
        healthy = slot.did_work or ran_s >= self.healthy_after_s
        slot.consecutive_failures = 0 if healthy else slot.consecutive_failures + 1
        slot.restarts += 1
        for hook in self.restart_hooks:
            hook(slot)
        return self.backoff.delay_s(slot.consecutive_failures)

    # ---- each launcher's own -------------------------------------------------------------------------
    @abc.abstractmethod
    async def _start(self, slot: WorkerSlot, bootstrap: WorkerBootstrap) -> P:
        """Start the slot's next worker."""

    @abc.abstractmethod
    async def _wait(self, slot: WorkerSlot, process: P) -> WorkerExit:
        """Until the worker has ended (its resources freed)."""

    @abc.abstractmethod
    async def stop_all(self, grace_s: float = 5.0) -> None:
        """Stop every worker (the server is shutting down); no restarts after this."""


def describe_exit(code: int) -> str:
    """A process's exit code in words: "code 1", "signal SIGKILL"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
