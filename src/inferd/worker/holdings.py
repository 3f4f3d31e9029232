"""The models a pool worker holds: their loads, their model servers, their turns on the device, and the
evictions `pools/residency.py` decides.

Each model held is served by a **model server**: a `Worker` (worker/main.py) of that model in this process,
whose Device was handed the model loaded and warmed up (`Device.adopt`). It joins every front end as any
worker of the model does (Hello with `pool=NAME`, Ready at once), so batching, routing, credits, recovery
and drains are the batch kind's. The model servers take turns on the one device: a batch runs under the
pool's compute lock (`Turn`), one at a time across the models. A load runs in its model's own thread
beside them, never under that lock; its size is measured around its load and warm-up (worker/memory.py)
and replaces the estimate from then on (when it ran alone: beside another load or an unload the measure
would count theirs too, and the size it was planned at stays). An eviction or an unload drains the model
server (Drain to each front end, which answers after the last batch it sent), then unloads the model
(`Model.unload`, collect, malloc_trim).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, Protocol

import msgspec

from inferd.clock import MonotonicClock
from inferd.config import ModelConfig
from inferd.pools.residency import LOADING, READY, Evict, FailLoad, Joined, Key, Limits, Residency, StartLoad
from inferd.wire import protocol as p
from inferd.worker import memory
from inferd.worker.credits import CreditLedger, Seat
from inferd.worker.device import Device
from inferd.worker.fronts import FrontLink, tell_credits

log = logging.getLogger("inferd.worker")


class ModelServer(Protocol):
    """What serves one model the pool worker holds: a `Worker` (worker/main.py) around its Device."""

    device: Device
    links: Mapping[int, FrontLink]
    """Its front ends joined (their batch slots: the pool worker's one ledger, `Holdings.tell_credits`)."""
    draining: bool

    async def run(self) -> int: ...

    def drain(self, signalled: bool = False) -> bool: ...


ModelServers = Callable[[str, int, Device, Seat, Callable[[], None]], ModelServer]
"""Makes the model server of (model, version) around its Device, with its seat on the pool worker's ledger
and what tells every model's front ends their slots (worker/pool.py: a `Worker`)."""


def estimate_mb(config_json: bytes) -> float:
    """The model's declared size (its model.toml `memory_mb`), planned with before a load measures it."""
    return float(msgspec.json.decode(config_json, type=dict).get("memory_mb") or 0.0)


class Turn:
    """One model's turn on the pool worker's device: the lock its model servers share around each batch,
    with the residency told the model is busy (waiting or running) and, after, idle."""

    def __init__(self, holdings: Holdings, key: Key) -> None:
        self.holdings = holdings
        self.key = key

    async def __aenter__(self) -> None:
        self.holdings.residency.busy(self.key)
        try:
            await self.holdings.compute.acquire()
        except BaseException:
            self._done()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.holdings.compute.release()
        self._done()

    def _done(self) -> None:
        self.holdings.residency.idle(self.key)
        self.holdings.changed()


class Holdings:
    def __init__(
        self, worker_id: str, model_repo: Path | None, tell: Callable[[p.Message], None], servers: ModelServers
    ) -> None:
        self.worker_id = worker_id
        self.model_repo = model_repo
        self.tell = tell
        """Sends a message to every front end (on its pool link)."""
        self.model_servers = servers
        self.residency = Residency(Limits(budget_mb=0.0), MonotonicClock())
        """Replaced by `configure` (the first Welcome says the pool's budget and limits)."""
        self.compute = asyncio.Lock()
        """The device: one batch at a time across the models (each model server's `Turn`)."""
        self.ledger = CreditLedger(MonotonicClock())
        """The device's batch slots (1 running + 1 staged), shared by the model servers (each has a `Seat`):
        the cap holds across the models, and a front end told "idle" is told the device is."""
        self.configs: dict[Key, bytes] = {}
        """The config the last load of each model asked for (its model server serves it); kept while the
        model is held or its load waits (`_forget`), so it holds no more than the residency bounds."""
        self.servers: dict[Key, ModelServer] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        """Loads and model servers running (each unloads its model when it ends)."""
        self.load_s: dict[Key, float] = {}
        """What each model's load here took (load and warm-up), while it is held."""
        self._measuring: dict[Key, bool] = {}
        """The loads being measured, and whether each ran alone so far (no other load, no unload beside
        it: resident memory would count theirs too)."""
        self.loads: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.closed = False
        """Draining: no new load."""
        self._changed = asyncio.Event()
        self._gone = asyncio.Event()
        """A model left the residency (unloaded, or its load failed)."""
        self._told: object = None
        self._tg: asyncio.TaskGroup | None = None

    def configure(self, limits: Limits) -> None:
        self.residency = Residency(limits, MonotonicClock())

    def changed(self) -> None:
        """Something the residency knows changed: plan again, and tell the front ends if what they see did."""
        self._changed.set()

    # ---- what the front ends ask -------------------------------------------------------------------------
    def ask(self, msg: p.LoadModel) -> p.LoadResult | None:
        """A LoadModel: the answer for the front end that asked when there is one at once (loaded already,
        too big, draining); else the load is queued or joined, and its LoadResult goes to every front end."""
        key = (msg.model, msg.version)
        if self.closed:
            return p.LoadResult(msg.model, msg.version, False, error=f"pool worker {self.worker_id} drains")
        asked = self.residency.ask(key, estimate_mb(msg.config_json), msg.wait_s)
        if isinstance(asked, FailLoad):
            log.warning("pool worker %s: %s", self.worker_id, asked.reason)
            return p.LoadResult(msg.model, msg.version, False, error=asked.reason)
        if isinstance(asked, Joined) and asked.ready:  # what its load took, as its LoadResult said
            size_mb = self.residency.held[key].size_mb
            return p.LoadResult(msg.model, msg.version, True, load_s=self.load_s.get(key, 0.0), memory_mb=size_mb)
        if not isinstance(asked, Joined):  # a new load: of the config asked now
            self.configs[key] = msg.config_json
        self.changed()
        return None

    def unload(self, key: Key) -> None:
        """An UnloadModel (or the worker drains): drain its model server, then unload it; a load not started
        is given up (LoadResult not ok), one under way is unloaded once it ends."""
        decided = self.residency.unload(key)
        if isinstance(decided, FailLoad):
            self._forget(key)
            self.tell(p.LoadResult(key[0], key[1], False, error=decided.reason))
        elif decided is True:
            self._drain_server(key)
        self.changed()

    def close(self) -> None:
        """The worker drains: no new load; every model is unloaded once its model server has drained."""
        self.closed = True
        for load in list(self.residency.pending):
            self.unload(load.key)
        for key, resident in list(self.residency.held.items()):
            if resident.state in (READY, LOADING):
                self.unload(key)

    async def emptied(self) -> None:
        """Returns once no model is held (every load ended, every model server drained and unloaded)."""
        while self.residency.held:
            self._gone.clear()
            await self._gone.wait()

    def state(self) -> p.PoolState:
        residency = self.residency
        now = residency.clock.now()
        return p.PoolState(
            budget_mb=residency.limits.budget_mb,
            used_mb=residency.used_mb(),
            models=[
                p.HeldModel(
                    r.key[0], r.key[1], r.state, r.size_mb,
                    idle_s=0.0 if r.busy or r.state == LOADING else now - r.last_used,
                    evictable=residency.evictable(r, now),
                )
                for r in residency.held.values()
            ],
            loads=dict(self.loads),
            evictions=dict(self.evictions),
            waiting_loads=len(residency.pending),
            queued=[p.QueuedLoad(load.key[0], load.key[1], load.size_mb) for load in residency.pending],
        )

    # ---- the planner -----------------------------------------------------------------------------------
    async def plan(self, tg: asyncio.TaskGroup) -> None:
        """After every event (or when the residency says time alone changes something): carry out what it
        decides, and tell the front ends what they see when it changed."""
        self._tg = tg
        while True:
            next_at = self.residency.next_at()
            timeout = None if next_at is None else max(0.0, next_at - self.residency.clock.now())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
            self._changed.clear()
            for action in self.residency.step():
                if isinstance(action, StartLoad):
                    self._spawn(self._load(action.key, action.size_mb))
                elif isinstance(action, Evict):
                    log.info("pool worker %s evicts %s v%d", self.worker_id, *action.key)
                    self.evictions[action.key[0]] += 1
                    self._drain_server(action.key)
                else:
                    log.warning("pool worker %s: %s", self.worker_id, action.reason)
                    self._forget(action.key)
                    self.tell(p.LoadResult(action.key[0], action.key[1], False, error=action.reason))
            self._publish()

    def _publish(self) -> None:
        """PoolState to every front end when what they see changed: a model's state or size, the loads,
        evictions, the loads queued. Idle times and `evictable` (which flips with every batch) go with the
        heartbeats only: a PoolState per batch to every front end would cost more than it tells."""
        state = self.state()
        seen = (state.used_mb, [(m.model, m.version, m.state, m.memory_mb) for m in state.models],
                state.loads, state.evictions, [(q.model, q.version, q.memory_mb) for q in state.queued])
        if seen != self._told:
            self._told = seen
            self.tell(state)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        assert self._tg is not None
        task = self._tg.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ---- one model: load, serve, unload ------------------------------------------------------------------
    async def _load(self, key: Key, planned_mb: float) -> None:
        """Load and warm up the model in its own thread (beside the batches of the others), measure what it
        took, tell every front end, and start its model server."""
        config_json = self.configs[key]
        device = Device(self.worker_id, self.model_repo, compute=Turn(self, key))
        self._disturb()
        self._measuring[key] = not self._measuring
        before = memory.reading()
        try:
            config = device.localize(ModelConfig(**msgspec.json.decode(config_json, type=dict)))
            model, load_s, warmup_s = await device.load_model(config)
        except (Exception, asyncio.CancelledError) as exc:  # a model that fails to load is reported
            self._measuring.pop(key, None)
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("pool worker %s: model %s v%d failed to load", self.worker_id, *key)
                self.tell(p.LoadResult(key[0], key[1], False, error=f"{type(exc).__name__}: {exc}"))
            try:
                await asyncio.shield(self._release(device))
            finally:
                self.residency.load_failed(key)
                self._forget(key)
                self._gone.set()
                self.changed()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        # measured beside another load or an unload, the growth is theirs too: keep the size it was planned at
        size_mb = before.grown_to(memory.reading()) if self._measuring.pop(key) else planned_mb
        keep = self.residency.loaded(key, size_mb)
        self.loads[key[0]] += 1
        self.load_s[key] = load_s + warmup_s
        log.info("pool worker %s loaded %s v%d in %.2fs (warm-up %.3fs): %.1f MB (planned %.1f MB)",
                 self.worker_id, key[0], key[1], load_s, warmup_s, size_mb, planned_mb)
        self.tell(p.LoadResult(key[0], key[1], True, load_s=load_s + warmup_s, memory_mb=size_mb))
        device.adopt(model, config, config_json)
        del model
        seat = Seat(self.ledger, key, lambda held: self._held(key, held))
        server = self.model_servers(key[0], key[1], device, seat, self.tell_credits)
        self.servers[key] = server
        if not keep or self.closed:  # asked to unload while it loaded, or the worker drains
            self.residency.unload(key)
            server.drain()
        self.changed()
        self._spawn(self._serve(key, server, seat))

    async def _serve(self, key: Key, server: ModelServer, seat: Seat) -> None:
        """Run a model server until it has drained (an eviction, an unload) or ended (every front end
        refused or dropped it); then unload its model and give its memory back."""
        try:
            await server.run()
        except Exception:
            log.exception("pool worker %s: the model server of %s v%d failed", self.worker_id, *key)
        finally:
            self.servers.pop(key, None)
            seat.close()  # what it still counted frees its slots: the other models' front ends get them
            self.tell_credits()
            try:
                await asyncio.shield(self._release(server.device))
            finally:
                self.residency.unloaded(key)
                self._forget(key)
                self._gone.set()
                log.info("pool worker %s unloaded %s v%d", self.worker_id, *key)
                self.changed()

    def tell_credits(self) -> None:
        """Hand out the device's free batch slots to the front ends of every model server but the draining
        ones, and tell those holding slots what runs on the device (`fronts.tell_credits`)."""
        links = {
            (key, index): link
            for key, server in self.servers.items() if not server.draining
            for index, link in server.links.items()
        }
        tell_credits(self.ledger, links)

    def _held(self, key: Key, change: int) -> None:
        """A batch of the model was received (+1) or finished (-1): a model holding batches (running,
        waiting for the device, or staged behind another) is busy, never evicted."""
        if change > 0:
            self.residency.busy(key)
        else:
            self.residency.idle(key)
        self.changed()

    def _forget(self, key: Key) -> None:
        """What is kept for a model while it is held or waits to load, once it is neither (a load asked
        again meanwhile keeps the config it asked for)."""
        if not self.residency.knows(key):
            self.configs.pop(key, None)
            self.load_s.pop(key, None)

    async def _release(self, device: Device) -> None:
        """Unload the device's model and give its memory back (collect, trim: in a thread, off the loop)."""
        self._disturb()
        await device.unload()
        await asyncio.to_thread(memory.give_back)

    def _disturb(self) -> None:
        """Memory is taken or given back beside the loads being measured: their measures count it too."""
        for key in self._measuring:
            self._measuring[key] = False

    def _drain_server(self, key: Key) -> None:
        server = self.servers.get(key)
        if server is not None:
            server.drain()
