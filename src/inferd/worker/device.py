"""A worker's device: the model it loaded, and one batch at a time on it (in a thread, so heartbeats and the
staged batch keep flowing while it computes). Shared by the front ends the worker serves.

A pool worker (worker/pool.py) has one Device per model it holds: each loads its model (`load_model`), is
handed to a model server already holding it (`adopt`), and takes its turn on the one real device through
the pool's `compute` lock, shared by all of them."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import msgspec

from inferd.clock import MonotonicClock
from inferd.config import ModelConfig
from inferd.kinds.llm.engine import LLMEngine, new_scheduler, scheduler_config
from inferd.kinds.llm.model import LLMModel
from inferd.models.base import Model
from inferd.models.loader import instantiate
from inferd.observability import tracing
from inferd.wire import protocol as p
from inferd.worker.fronts import FrontLink, SequenceOwners
from inferd.worker.outputs import OutputError, convert_outputs

log = logging.getLogger("inferd.worker")


class Device:
    def __init__(
        self, worker_id: str, model_repo: Path | None, compute: AbstractAsyncContextManager[object] | None = None
    ) -> None:
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
        self.compute: AbstractAsyncContextManager[object] = compute or asyncio.Lock()
        """Held around each batch: this device's own lock, or a pool worker's turn on the device its models
        share (one batch at a time across them)."""
        self.adopted = False
        """It was handed a model loaded already (a pool's model server): a front end's Welcome for the same
        model version is served by it, never loaded again."""

    async def ensure_loaded(self, link: FrontLink, welcome: p.Welcome) -> bool:
        """Load the model the front end's Welcome names (unless loaded already), then tell it Ready
        (or LoadFailed: returns False)."""
        async with self._lock:
            if self.adopted and not self._holds(welcome, link):
                return False
            if self.model is not None and (welcome.model_config_json == self.config_json or self.adopted):
                assert self.config is not None
                link.send(p.Ready(version=self.config.version, load_s=0.0, warmup_s=0.0))
                log.info(
                    "worker %s registered again with %s (model already loaded)", self.worker_id, link.address
                )
                return True
            config = self.localize(ModelConfig(**msgspec.json.decode(welcome.model_config_json, type=dict)))
            self.model = await self._load(link, config)
            if self.model is None:
                return False
            self.config_json = welcome.model_config_json
            self.loaded.set()
            return True

    def adopt(self, model: Model, config: ModelConfig, config_json: bytes) -> None:
        """Serve `model`, loaded and warmed up already (`load_model`): a pool's model server."""
        self.model, self.config, self.config_json = model, config, config_json
        self.adopted = True
        self.loaded.set()

    def _holds(self, welcome: p.Welcome, link: FrontLink) -> bool:
        """The adopted model is the version the front end's Welcome names (else LoadFailed, naming both)."""
        assert self.config is not None
        named = msgspec.json.decode(welcome.model_config_json, type=dict)
        if (named.get("name"), named.get("version")) == (self.config.name, self.config.version):
            return True
        link.send(p.LoadFailed(
            f"this model server holds {self.config.name} v{self.config.version}, not "
            f"{named.get('name')} v{named.get('version')}"
        ))
        return False

    def localize(self, config: ModelConfig) -> ModelConfig:
        """A model file path from another host's repository, mapped into this worker's --model-repo."""
        target, _, cls = config.implementation.rpartition(":")
        if not target.endswith(".py") or Path(target).is_file() or self.model_repo is None:
            return config
        local = self.model_repo / config.name / str(config.version) / "model.py"
        return config.model_copy(update={"implementation": f"{local}:{cls}"})

    async def load_model(self, config: ModelConfig) -> tuple[Model, float, float]:
        """Load the model (in this device's thread) and run its warm-up: (model, load s, warm-up s). Raises
        what the model raised."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        model = instantiate(config)
        await loop.run_in_executor(self.executor, model.load)
        t1 = time.perf_counter()
        warm = model.warmup_inputs()
        if warm:
            result = await self.predict(model, warm)
            convert_outputs(config, result, len(warm))
        return model, t1 - t0, time.perf_counter() - t1

    async def _load(self, link: FrontLink, config: ModelConfig) -> Model | None:
        try:
            model, load_s, warmup_s = await self.load_model(config)
        except Exception as exc:  # a model that fails to load is reported, not crashed on
            log.exception("model %s failed to load", config.name)
            link.send(p.LoadFailed(message=f"{type(exc).__name__}: {exc}"))
            await link.flush()
            return None
        self.config = config
        link.send(p.Ready(version=config.version, load_s=load_s, warmup_s=warmup_s))
        log.info(
            "worker %s ready: model %s v%d loaded in %.2fs, warm-up %.3fs",
            self.worker_id,
            config.name,
            config.version,
            load_s,
            warmup_s,
        )
        return model

    async def unload(self) -> None:
        """Free the model (its `unload` hook, in the device's thread) and the thread: a pool's eviction. The
        caller drops the device and collects (worker/memory.py `give_back`)."""
        model, self.model = self.model, None
        self.loaded.clear()
        if model is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, model.unload)
        self.executor.shutdown(wait=False)

    def new_engine(self, owners: SequenceOwners) -> LLMEngine | None:
        """The continuous-batching engine when the model is an LLM (instead of the batch loop)."""
        if not isinstance(self.model, LLMModel):
            return None
        assert self.config is not None
        scheduler = new_scheduler(scheduler_config(self.config.params), MonotonicClock())
        return LLMEngine(self.model, scheduler, owners.send, owners.flush, self.executor)

    async def run_one(self, batch: p.RunBatch) -> p.BatchDone:
        async with self.compute:
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
