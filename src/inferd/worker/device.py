"""A worker's device: the model it loaded, and one batch at a time on it (in a thread, so heartbeats and the
staged batch keep flowing while it computes). Shared by the front ends the worker serves."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from inferd.clock import MonotonicClock
from inferd.config import ModelConfig
from inferd.kinds.llm.engine import LLMEngine, new_scheduler, scheduler_config
from inferd.kinds.llm.model import LLMModel
from inferd.kinds.llm.warmup import warm_up
from inferd.models.base import Model
from inferd.models.loader import instantiate
from inferd.observability import tracing
from inferd.wire import protocol as p
from inferd.worker.fronts import FrontLink, SequenceOwners
from inferd.worker.outputs import OutputError, convert_outputs

log = logging.getLogger("inferd.worker")


class Device:
    def __init__(self, worker_id: str, model_repo: Path | None) -> None:
        self.worker_id = worker_id
        self.model_repo = model_repo
        self.model: Model | None = None
        self.config: ModelConfig | None = None
        self.config_json = b""
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferd-device")
        self.loaded = asyncio.Event()
        self.running = 0
        """Batches on the device now (0 or 1), for the heartbeats."""
        self.completed = 0
        self._lock = asyncio.Lock()

    async def ensure_loaded(self, link: FrontLink, welcome: p.Welcome) -> bool:
        """Load the model the front end's Welcome names (unless loaded already), then tell it Ready
        (or LoadFailed: returns False)."""
        async with self._lock:
            if welcome.model_config_json == self.config_json and self.model is not None:
                assert self.config is not None
                link.send(p.Ready(version=self.config.version, load_s=0.0, warmup_s=0.0))
                log.info(
                    "worker %s registered again with %s (model already loaded)", self.worker_id, link.address
                )
                return True
            config = self._localize(ModelConfig(**msgspec.json.decode(welcome.model_config_json, type=dict)))
            self.model = await self._load(link, config)
            if self.model is None:
                return False
            self.config_json = welcome.model_config_json
            self.loaded.set()
            return True

    def _localize(self, config: ModelConfig) -> ModelConfig:
        """A model file path from another host's repository, mapped into this worker's --model-repo."""
        target, _, cls = config.implementation.rpartition(":")
        if not target.endswith(".py") or Path(target).is_file() or self.model_repo is None:
            return config
        local = self.model_repo / config.name / str(config.version) / "model.py"
        return config.model_copy(update={"implementation": f"{local}:{cls}"})

    async def _load(self, link: FrontLink, config: ModelConfig) -> Model | None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            model = instantiate(config)
            await loop.run_in_executor(self.executor, model.load)
            t1 = time.perf_counter()
            if isinstance(model, LLMModel):  # a short prefill and decode (kinds/llm/warmup.py)
                await loop.run_in_executor(self.executor, warm_up, model)
            elif warm := model.warmup_inputs():
                result = await self.predict(model, warm)
                convert_outputs(config, result, len(warm))
        except Exception as exc:  # a model that fails to load is reported, not crashed on
            log.exception("model %s failed to load", config.name)
            link.send(p.LoadFailed(message=f"{type(exc).__name__}: {exc}"))
            await link.flush()
            return None
        t2 = time.perf_counter()
        self.config = config
        log.info(
            "worker %s ready: model %s v%d loaded in %.2fs, warm-up %.3fs",
            self.worker_id,
            config.name,
            config.version,
            t1 - t0,
            t2 - t1,
        )
        # Ready only after the warm-up: the front end sends the worker no work before it (the gate; logged
        # first, so the worker's log shows the warm-up's end before the front end could hear of it)
        link.send(p.Ready(version=config.version, load_s=t1 - t0, warmup_s=t2 - t1))
        return model

    def new_engine(self, owners: SequenceOwners) -> LLMEngine | None:
        """The continuous-batching engine when the model is an LLM (instead of the batch loop)."""
        if not isinstance(self.model, LLMModel):
            return None
        assert self.config is not None
        scheduler = new_scheduler(scheduler_config(self.config.params), MonotonicClock())
        return LLMEngine(self.model, scheduler, owners.send, owners.flush, self.executor)

    async def run_one(self, batch: p.RunBatch) -> p.BatchDone:
        self.running = 1
        with tracing.compute(batch.traceparent, batch.batch_id, len(batch.items), self.worker_id):
            done = await self._run(batch)
        self.running = 0
        self.completed += 1
        return done

    async def _run(self, batch: p.RunBatch) -> p.BatchDone:
        start = time.perf_counter()
        assert self.model is not None and self.config is not None
        try:
            outputs = await self.predict(self.model, batch.items)
            converted, errors = convert_outputs(self.config, outputs, len(batch.items))
        except OutputError as exc:
            return p.BatchDone(
                batch.batch_id, time.perf_counter() - start, batch_error=("ModelOutputError", str(exc))
            )
        except Exception as exc:  # the model raised: its callers get a ModelError naming it
            message = f"model '{self.config.name}' raised {type(exc).__name__}: {exc}"
            log.warning("batch %d failed: %s", batch.batch_id, message)
            return p.BatchDone(
                batch.batch_id, time.perf_counter() - start, batch_error=("ModelError", message)
            )
        item_errors = {i: ("ModelError", m) for i, m in errors.items()}
        return p.BatchDone(
            batch.batch_id, time.perf_counter() - start, outputs=converted, item_errors=item_errors
        )

    async def predict(self, model: Model, items: list) -> object:
        if inspect.iscoroutinefunction(model.predict_batch):
            return await model.predict_batch(items)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, model.predict_batch, items)
