"""Changing the fleet while it serves: scale a model's local workers up or down (scale-down drains first)
and roll a model to a new version worker by worker (the old version answers until the new is ready)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from inferd.config import ConfigError
from inferd.errors import BadRequest, NotFound
from inferd.worker.connection import WorkerConnection, WorkerState
from inferd.worker.supervisor import WorkerSlot

if TYPE_CHECKING:
    from inferd.batching.dispatcher import ModelRuntime
    from inferd.server import InferenceServer

log = logging.getLogger("inferd.fleet")


class FleetControl:
    def __init__(self, server: InferenceServer, ready_timeout_s: float = 120.0) -> None:
        self.server = server
        self.ready_timeout_s = ready_timeout_s
        self._locks: dict[str, asyncio.Lock] = {}

    def local_workers(self, model: str) -> int:
        return len(self.server.supervisor.live_slots(model))

    async def scale_to(self, model: str, workers: int) -> int:
        """Set the number of local workers; removed ones are drained (they finish what they hold)."""
        rt = self.server.runtime(model)
        if not 0 <= workers <= 64:
            raise BadRequest(f"workers must be within 0..64, got {workers}")
        async with self._lock(model):
            live = self.server.supervisor.live_slots(model)
            if workers > len(live):
                self.server.supervisor.add(model, workers - len(live))
                log.info("model %s: scaling up from %d to %d local workers", model, len(live), workers)
            elif workers < len(live):
                victims = sorted(live, key=lambda s: self._load(rt, s))[: len(live) - workers]
                log.info(
                    "model %s: scaling down from %d to %d local workers (draining %s)",
                    model,
                    len(live),
                    workers,
                    [s.worker_id for s in victims],
                )
                for slot in victims:
                    self._retire(rt, slot)
            return workers

    async def rolling_update(self, model: str) -> dict[str, object]:
        """Load the model's highest version from the repository into new workers, one at a time, each
        replacing (by drain) one worker of the old version once it is ready."""
        from inferd.models.repository import apply_overrides, load_model_folder

        rt = self.server.runtime(model)
        repo = self.server.config.model_repo
        if repo is None:
            raise BadRequest("the server runs without --model-repo: there is no newer version to load")
        try:
            (new,) = apply_overrides(
                [load_model_folder(repo / model)],
                {k: v for k, v in self.server.config.model_overrides.items() if k == model},
            )
        except ConfigError as exc:
            raise BadRequest(f"cannot load model {model!r} from {repo}: {exc}") from None
        old_version = rt.config.version
        if new.version <= old_version:
            return {"model": model, "from": old_version, "to": old_version, "replaced": 0}
        if new.inputs != rt.config.inputs or new.outputs != rt.config.outputs:
            raise BadRequest(
                f"version {new.version} of {model!r} changes the model's tensors; a rolling update "
                "needs the same inputs and outputs (restart the server instead)"
            )
        async with self._lock(model):
            rt.config = new  # workers that connect from now on load the new version
            old_slots = list(self.server.supervisor.live_slots(model))
            log.info(
                "model %s: rolling update v%d -> v%d over %d worker(s)",
                model,
                old_version,
                new.version,
                len(old_slots),
            )
            for slot in old_slots:
                (fresh,) = self.server.supervisor.add(model, 1)
                await self._wait_ready(rt, fresh, new.version)
                self._retire(rt, slot)
                await self._wait_gone(rt, slot)
        return {"model": model, "from": old_version, "to": new.version, "replaced": len(old_slots)}

    def _retire(self, rt: ModelRuntime, slot: WorkerSlot) -> None:
        self.server.supervisor.retire(slot)
        worker = self._worker(rt, slot)
        if worker is not None:
            rt.drain_worker(worker)
        elif slot.process is not None and slot.process.returncode is None:
            slot.process.terminate()  # still starting: nothing to drain

    async def _wait_ready(self, rt: ModelRuntime, slot: WorkerSlot, version: int) -> None:
        async with asyncio.timeout(self.ready_timeout_s):
            while True:
                w = self._worker(rt, slot)
                if w is not None and w.state is WorkerState.READY and w.version == version:
                    return
                await rt.membership_changed()

    async def _wait_gone(self, rt: ModelRuntime, slot: WorkerSlot) -> None:
        async with asyncio.timeout(self.ready_timeout_s):
            while self._worker(rt, slot) is not None:
                await rt.membership_changed()

    @staticmethod
    def _worker(rt: ModelRuntime, slot: WorkerSlot) -> WorkerConnection | None:
        return next((w for w in rt.workers if w.slot_id == slot.worker_id), None)

    def _load(self, rt: ModelRuntime, slot: WorkerSlot) -> tuple[int, int]:
        w = self._worker(rt, slot)
        return (0, -slot.index) if w is None else (1 + len(w.inflight), -slot.index)

    def _lock(self, model: str) -> asyncio.Lock:
        if model not in self.server.runtimes:
            raise NotFound(f"unknown model {model!r}")
        return self._locks.setdefault(model, asyncio.Lock())
