"""The front end's side of one pool: `PoolManager`, one per `[pools.NAME]` on each front end.

* **Pool links.** Each pool worker joins with `Hello(model="", pool=NAME)` (the hub hands the connection
  here); the manager answers Welcome with the pool's settings, then keeps the worker's last `PoolState`
  (what it holds, its budget and use, its cumulative loads and evictions) and reads its `LoadResult`s.
  A link silent past the heartbeat timeout is cut. A worker id joining again replaces its old link;
  when another process joins under it (a remote worker restarted with the same --worker-id before its
  old link was seen closed), the old process is gone: the loads asked of it are forgotten.
* **Placement.** On each wake (a pooled model's request with no worker in service) and on a timer, it
  asks `Placement` (pools/placement.py) where to load, and sends LoadModel. With several front ends,
  only the one that `spreads` (holds the `decider` lease) gives hot models more holders. A pooled model's worker is
  the model server the pool worker starts for it: it joins as an ordinary worker of that model, so
  routing, batching and recovery are the batch kind's.
* **The Waker** (runtime/waking.py) of its pooled models: `wakeable` (a pool with no worker, a load in
  backoff: why not; the model's own readiness and index reason, never the server's readiness:
  runtime/readiness.py), `wake`, `eta_s` (the model's measured load time).
* **Failures.** A failed load fails that model's waiting requests with a 503 naming the cause (through
  `fail_waiting`, the composition root's hook into the model's runtime) and backs off.
* **Unload** (the repository API): UnloadModel to every pool worker; each drains the model first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.config.pools import PoolConfig
from inferd.errors import ServingError, WorkerUnavailable
from inferd.pools.metrics import PoolMetrics
from inferd.pools.placement import QUEUED, Load, ModelDemand, Placement, WorkerView
from inferd.wire import protocol as p

log = logging.getLogger("inferd.pools")

TICK_S = 0.25
"""How often placement runs without a wake (spreading hot models) and silent links are looked for."""
DEFAULT_WAIT_S = 30.0
"""How long a load may wait for room when the model sets no default timeout."""
JOIN_GRACE_S = 10.0
"""How long loads that no joined worker has room for wait for the pool's own workers to join (start, a
restart) before they are sent to wait at one for room: a worker that never joins holds none for good."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A pooled model version served here, as the composition root reads it from its runtime."""

    config: ModelConfig
    waiting: int
    """Items waiting for it here."""
    serving: int
    """Its workers in service here."""
    batch_cycle_s: float
    """One batching wait plus one batch time (see ModelDemand)."""
    elsewhere: int = 0
    """Items waiting for it on the other front ends, as they last reported (see ModelDemand)."""


@dataclass(eq=False)
class PoolLink:
    """The front end's side of one pool worker's pool link."""

    worker_id: str
    pid: int
    host: str
    writer: asyncio.StreamWriter
    connected_at: float
    last_heard: float
    state: p.PoolState | None = None
    draining: bool = False

    def send(self, msg: p.Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(p.encode_frame(msg))

    def holds_ready(self, key: tuple[str, int]) -> bool:
        """Its last PoolState lists the model version ready (a load that ends is sent before the
        PoolState that says it is ready: its LoadResult finds the model loading, or not listed)."""
        state = self.state
        return state is not None and any((m.model, m.version) == key and m.state == "ready" for m in state.models)

    def serves(self) -> bool:
        """Its last PoolState lists a model ready: a batch of it, not a load, may be what ended the worker."""
        return self.state is not None and any(m.state == "ready" for m in self.state.models)

    def view(self, budget_mb: float, max_models: int | None = None) -> WorkerView:
        state = self.state
        if state is None:  # joined, no PoolState yet: its whole budget is free
            return WorkerView(self.worker_id, budget_mb, 0.0, {}, not self.draining, slots=max_models)
        held = {(m.model, m.version): m.state for m in state.models}
        held.update({(q.model, q.version): QUEUED for q in state.queued})  # one waiting for a copy that leaves
        queued_mb = sum(q.memory_mb for q in state.queued)
        evictable = tuple((m.memory_mb, m.idle_s) for m in state.models if m.evictable)
        slots = None if max_models is None else max_models - len(held)  # its own count: every one held or queued
        return WorkerView(
            self.worker_id, state.budget_mb, state.used_mb, held, not self.draining, evictable, slots, queued_mb
        )


class PoolManager:
    def __init__(
        self,
        name: str,
        config: PoolConfig,
        clock: Clock,
        served: Callable[[], list[ServedModel]],
        config_of: Callable[[str, int], ModelConfig | None],
        fail_waiting: Callable[[str, int, ServingError], None],
        metrics: PoolMetrics,
        placement: Placement | None = None,
        silence_timeout_s: float = 5.0,
        heartbeat_s: float = 1.0,
        spreads: Callable[[], bool] = lambda: True,
    ) -> None:
        self.name = name
        self.config = config
        self.clock = clock
        self.served = served
        """The pool's model versions served here, with their demand (read at each placement)."""
        self.config_of = config_of
        """A pooled model version's settings (None: not served here): what a wake needs, cheaply."""
        self.fail_waiting = fail_waiting
        """Fail a model version's waiting requests (its load failed)."""
        self.metrics = metrics
        self.placement = placement or Placement(clock)
        self.silence_timeout_s = silence_timeout_s
        self.heartbeat_s = heartbeat_s
        self.spreads = spreads
        """Whether this front end gives hot models more holders now (with several front ends, the one
        that holds the `decider` lease only: see pools/placement.py)."""
        self.links: dict[str, PoolLink] = {}
        self._sizes: dict[tuple[str, int], float] = {}
        """Measured sizes (LoadResult, PoolState), which replace the estimates."""
        self._load_s: dict[tuple[str, int], float] = {}
        self._errors: dict[tuple[str, int], str] = {}
        self._short_since: float | None = None
        """Since when fewer workers than the pool's own have joined (None: all of them have)."""

    # ---- the Waker of its models ----------------------------------------------------------------------
    def wakeable(self, model: str, version: int) -> str | WorkerUnavailable | None:
        """None, or why not: the pool has no worker (and none of its own coming), the model (as a load
        measured it) is bigger than every worker's budget, or its last load failed and its backoff runs
        (the 503 then says when to retry: the backoff left)."""
        if not self.links and self.config.workers == 0:
            return (
                f"pool {self.name!r} has no worker: start one with `inferd worker --pool {self.name} "
                f"--connect HOST:PORT`, or set workers in [pools.{self.name}]"
            )
        config = self.config_of(model, version)
        refusal = None if config is None or not self.links else self.load_refusal(config)
        if refusal is not None:  # measured bigger than any worker's budget: no load could ever hold it
            return refusal
        left = self.placement.retry_in(model, version)
        if left is not None:
            return WorkerUnavailable(
                f"loading model {model!r} version {version} on pool {self.name!r} failed: "
                f"{self._errors.get((model, version), 'unknown error')}; the next try is in {left:.1f} s",
                retry_after_s=left,
            )
        return None

    def wake(self, model: str, version: int, waiting: int, oldest_age_s: float) -> None:
        """Called on each admission while no worker serves the model, and every 0.25 s while requests
        wait: cheap (one placement of this model alone), and a load pending or in progress is not
        asked again."""
        config = self.config_of(model, version)
        if config is not None and config.pool == self.name:
            self._place([self._demand(ServedModel(config, waiting, 0, config.max_wait_s), waiting)])

    def eta_s(self, model: str, version: int) -> float | None:
        return self._load_s.get((model, version))

    # ---- placement ------------------------------------------------------------------------------------
    def size_mb(self, config: ModelConfig) -> float:
        """What one copy takes: measured by a load, else its estimate."""
        return self._sizes.get((config.name, config.version), config.memory_mb or 0.0)

    def _demand(self, served: ServedModel, waiting: int) -> ModelDemand:
        c = served.config
        return ModelDemand(
            c.name, c.version, waiting, served.serving, self.size_mb(c), c.max_batch_size, served.batch_cycle_s,
            served.elsewhere,
        )

    def place(self) -> list[Load]:
        """One placement pass over every pooled model's demand here (the timer's)."""
        return self._place([self._demand(s, s.waiting) for s in self.served()])

    def _place(self, demands: list[ModelDemand]) -> list[Load]:
        views = [link.view(self.config.memory_budget_mb, self.config.max_loaded_models) for link in self.links.values()]
        loads = self.placement.plan(views, demands, patient=self._joining(len(views)), spreads=self.spreads())
        for load in loads:
            config = self.config_of(load.model, load.version)
            if config is not None:
                self._send_load(load, config)
        return loads

    def _joining(self, joined: int) -> bool:
        """Whether the pool's own workers are still joining (fewer joined, for less than JOIN_GRACE_S)."""
        if joined >= self.config.workers:
            self._short_since = None
            return False
        now = self.clock.now()
        if self._short_since is None:
            self._short_since = now
        return now - self._short_since < JOIN_GRACE_S

    def _send_load(self, load: Load, config: ModelConfig) -> None:
        link = self.links[load.worker_id]
        wait_s = (config.default_timeout_ms / 1000.0) if config.default_timeout_ms else DEFAULT_WAIT_S
        log.info(
            "pool %s: loading model %s v%d on %s (%s, %.0f MiB)",
            self.name, load.model, load.version, load.worker_id,
            "one more holder" if load.spread else "first holder", self.size_mb(config),
        )
        link.send(p.LoadModel(load.model, load.version, config.model_dump_json().encode(), wait_s))

    def unload(self, model: str, version: int) -> list[str]:
        """UnloadModel to every pool worker (each drains the model first, then unloads it; a worker that
        does not hold it ignores it); returns the workers told. The model's pending load and backoff go."""
        self.placement.forget(model, version)
        told = []
        for link in self.links.values():
            link.send(p.UnloadModel(model, version))
            told.append(link.worker_id)
        return told

    def load_refusal(self, config: ModelConfig) -> str | None:
        """Why no worker of the pool could hold this model (its size, measured or estimated, above every
        worker's budget, with the sizes); None: it fits one. The repository API's 400 at load."""
        size = self.size_mb(config)
        budgets = [link.view(self.config.memory_budget_mb).budget_mb for link in self.links.values()]
        biggest = max(budgets, default=self.config.memory_budget_mb)
        if size <= biggest:
            return None
        return (
            f"model {config.name!r} takes {size:g} MiB, above the memory budget of every worker of pool "
            f"{self.name!r} (the largest: {biggest:g} MiB)"
        )

    # ---- the links ------------------------------------------------------------------------------------
    async def serve(self, hello: p.Hello, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One pool link, from the Welcome until it closes (the hub checked its protocol and token)."""
        now = self.clock.now()
        link = PoolLink(hello.worker_id, hello.pid, hello.host, writer, now, now)
        old = self.links.get(hello.worker_id)
        if old is not None:  # the same worker id again: the new link replaces the old one
            old.writer.transport.abort()
            if (old.pid, old.host) != (link.pid, link.host):  # another process (restarted under that id):
                self._gone(old)  # what was asked of the old one will never be answered
        self.links[hello.worker_id] = link
        log.info("pool %s: worker %s (pid %d on %s) joined", self.name, hello.worker_id, hello.pid, hello.host)
        try:
            link.send(
                p.Welcome(
                    accepted=True,
                    pool_config_json=self.config.model_dump_json().encode(),
                    heartbeat_s=self.heartbeat_s,
                    silence_timeout_s=self.silence_timeout_s,
                )
            )
            await writer.drain()
            while True:
                self.on_message(link, await p.read_message(reader))
        finally:
            if self.links.get(link.worker_id) is link:
                del self.links[link.worker_id]
                self._gone(link)
            log.info("pool %s: worker %s left", self.name, link.worker_id)

    def _gone(self, link: PoolLink) -> None:
        """The worker process behind the link is gone: the loads asked of it will not be answered."""
        for model, version in self.placement.worker_gone(link.worker_id, not link.serves()):
            self._load_failed(link, model, version, f"pool worker {link.worker_id} left while loading it")
        self.metrics.gone(self.name, link.worker_id)

    def on_message(self, link: PoolLink, msg: p.Message) -> None:
        link.last_heard = self.clock.now()
        if isinstance(msg, p.PoolState):
            self._on_state(link, msg)
        elif isinstance(msg, p.LoadResult):
            self._on_result(link, msg)
        elif isinstance(msg, p.Drain):  # it drains (SIGTERM): no more loads; a pool link holds no work
            if not link.draining:
                link.draining = True
                link.send(p.Drain())
                self.placement.worker_gone(link.worker_id)  # its waiting loads are given up: place them again
        elif not isinstance(msg, p.Heartbeat):
            log.warning("pool %s: worker %s sent %s on its pool link; ignored", self.name, link.worker_id, type(msg).__name__)

    def _on_state(self, link: PoolLink, state: p.PoolState) -> None:
        link.state = state
        for held in state.models:
            if held.state == "ready":
                self._sizes[(held.model, held.version)] = held.memory_mb
        self.metrics.counted(self.name, link.worker_id, state, f"{link.host}:{link.pid}")

    def _on_result(self, link: PoolLink, result: p.LoadResult) -> None:
        key = (result.model, result.version)
        if not result.ok and link.draining:  # refused or given up as it drains: not placed, not failed
            log.info("pool %s: worker %s drains: model %s v%d is loaded elsewhere (%s)", self.name,
                     link.worker_id, result.model, result.version, result.error)
            self.placement.worker_gone(link.worker_id)
            return
        self.placement.ended(result.model, result.version, link.worker_id, result.ok)
        if result.ok:
            self._errors.pop(key, None)
            if result.memory_mb > 0:
                self._sizes[key] = result.memory_mb
            if not link.holds_ready(key):  # else: asked of a worker that held it ready already (it
                self._load_s[key] = result.load_s  # answers with what that load took): no new load
                self.metrics.loaded(result.model, result.load_s)
            return
        self._load_failed(link, result.model, result.version, result.error)

    def _load_failed(self, link: PoolLink, model: str, version: int, error: str) -> None:
        """A load of the model on that worker failed (its backoff runs): its waiting requests get a 503."""
        self._errors[(model, version)] = error
        left = self.placement.retry_in(model, version) or 1.0
        log.warning(
            "pool %s: loading model %s v%d on %s failed: %s (next try in %.1f s)",
            self.name, model, version, link.worker_id, error, left,
        )
        why = WorkerUnavailable(
            f"loading model {model!r} version {version} on pool {self.name!r} failed: {error}", retry_after_s=left
        )
        self.fail_waiting(model, version, why)

    # ---- the timer ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Placement without a wake (spreading) and silent links, every TICK_S, until cancelled."""
        while True:
            await asyncio.sleep(TICK_S)
            self.tick()

    def tick(self) -> None:
        now = self.clock.now()
        for link in list(self.links.values()):
            if now - link.last_heard > self.silence_timeout_s:
                log.warning(
                    "pool %s: worker %s silent for %.1f s: its pool link is cut", self.name, link.worker_id,
                    now - link.last_heard,
                )
                link.writer.transport.abort()
        self.place()

    def close(self) -> None:
        for link in self.links.values():
            link.writer.close()

    # ---- the view (GET /admin/pools) ------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """The pool as operators see it: its settings, each worker's budget, use and models, the loads
        in flight and in backoff."""
        now = self.clock.now()
        workers = []
        for link in sorted(self.links.values(), key=lambda w: w.worker_id):
            state = link.state or p.PoolState(self.config.memory_budget_mb, 0.0)
            workers.append({
                "worker_id": link.worker_id, "pid": link.pid, "host": link.host, "draining": link.draining,
                "budget_mb": state.budget_mb, "used_mb": state.used_mb, "waiting_loads": state.waiting_loads,
                "silent_s": round(now - link.last_heard, 3),
                "models": [msgspec.to_builtins(m) for m in state.models],
                "queued": [msgspec.to_builtins(q) for q in state.queued],
            })
        backoff = {}
        for s in self.served():
            left = self.placement.retry_in(s.config.name, s.config.version)
            if left is not None:
                backoff[f"{s.config.name}:{s.config.version}"] = {
                    "retry_in_s": round(left, 3), "error": self._errors.get((s.config.name, s.config.version), "")
                }
        models = [
            {
                "model": s.config.name, "version": s.config.version, "waiting": s.waiting, "serving": s.serving,
                "memory_mb": self.size_mb(s.config), "load_s": self._load_s.get((s.config.name, s.config.version)),
                "loading_on": self.placement.pending(s.config.name, s.config.version),
            }
            for s in self.served()
        ]
        return {"name": self.name, "config": self.config.model_dump(), "workers": workers, "models": models,
                "backoff": backoff}
