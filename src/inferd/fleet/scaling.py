"""The autoscaling driver: observe a model's default version every interval through its runtime's
snapshot and its kind's observer, ask its Autoscaler (a pure policy, with the kind's demand), and act
through fleet control (which starts workers, or drains them before they go). What a model scales on is
its kind's (`Kind.autoscaling`, runtime/demand.py): batch models on batching-aware signals
(kinds/batch/demand.py), LLM models on their engines' pressure (kinds/llm/demand.py).

It acts only while its front end holds the lease of the server's decisions (`acts`). With several front
ends (`--frontends N`) the owner's loop runs alone and hands its kind's observer the
other front ends' reported loads (`others`, runtime/frontend_load.py): a batch model's queue depth,
arrival rate and busy ratio are the whole server's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferd.clock import Clock
from inferd.config import ConfigError
from inferd.fleet.autoscaler import Autoscaler, AutoscalerConfig, Decision
from inferd.fleet.control import FleetControl
from inferd.runtime.demand import Autoscaling, Observed, Observer
from inferd.runtime.frontend_load import FrontendLoads
from inferd.runtime.kinds import Kind, KindRegistry
from inferd.runtime.registry import ModelRegistry
from inferd.runtime.waking import SCALE_FROM_ZERO, Waker, Wakers

log = logging.getLogger("inferd.autoscaler")

HISTORY = 20
"""Fleet changes kept for the admin API."""

START_POLL_S = 0.05
"""While a start from zero is timed, how often the loop looks for a ready worker."""


def check_autoscalable(kind: Kind) -> Autoscaling:
    """Only kinds that declare their autoscaling scale (those whose workers are ours: batch, llm): an
    [autoscale] table on another is a start-up error."""
    if kind.autoscaling is None:
        raise ConfigError(f"[autoscale] is set on a {kind.name} model, which has no workers of ours: remove it")
    return kind.autoscaling


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """One model's: its Autoscaler, with its kind's demand, and its kind's observer."""

    autoscaler: Autoscaler
    observer: Observer


def scaling_policy(kind: Kind, config: AutoscalerConfig, clock: Clock) -> ScalingPolicy:
    scaling = check_autoscalable(kind)
    return ScalingPolicy(Autoscaler(config, clock, scaling.demand(config)), scaling.observer(clock))


def scaling_loops(
    registry: ModelRegistry,
    fleet: FleetControl,
    clock: Clock,
    kinds: KindRegistry,
    others: FrontendLoads | None,
    acts: Callable[[], bool] | None,
    wakers: Wakers,
    decides: bool = True,
    only: str | None = None,
) -> dict[str, ScalingLoop]:
    """A scaling loop for each served model whose default version has an [autoscale] table, registered as
    the waker (runtime/waking.py) of each `min_workers = 0` one. `decides`: False on a front end that runs
    no autoscaler (a follower of `--frontends N`): no loop, and such a model's waker is `ReportedDemand`.
    `only`: that model's alone (one loaded while serving: `ScalingLoops.renew`)."""
    loops: dict[str, ScalingLoop] = {}
    for rt in registry.defaults():
        config = rt.config.autoscale
        if config is None or (only is not None and rt.name != only):
            continue
        waker: Waker = ReportedDemand()
        if decides:
            policy = scaling_policy(kinds.get(rt.kind), config, clock)
            loops[rt.name] = loop = ScalingLoop(registry, fleet, clock, rt.name, policy, others=others, acts=acts)
            waker = loop
        if config.min_workers == 0:
            wakers.set(rt.name, waker, SCALE_FROM_ZERO)
    return loops


class ScalingLoops:
    """Runs the scaling loops (`loops`: by model, the admin API reads it) in a task group of their own, and
    makes a model's loop afresh when the model is served again while the server runs (a load through the
    repository API: fleet/model_control.py): from the [autoscale] table its folder holds now, with an
    autoscaler that has not seen the model yet (an older loop's remembered target is stale once the model
    was unloaded: its workers were stopped under it, and a `min_workers = 0` model would never wake)."""

    def __init__(self, build: Callable[[str | None], dict[str, ScalingLoop]], wakers: Wakers) -> None:
        self.build = build
        """`scaling_loops` over the server's models (None), or one model's (its name)."""
        self.wakers = wakers
        self.loops = build(None)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._tg: asyncio.TaskGroup | None = None

    async def run(self) -> None:
        """Every loop, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            try:
                for name, loop in self.loops.items():
                    self._start(name, loop)
                await asyncio.Event().wait()
            finally:
                self._tg = None

    def renew(self, model: str) -> None:
        """`model` is served anew (it was not served a moment ago): its loop, if any, stops, and one made
        from its config now takes its place (and its waker's, for a `min_workers = 0` model)."""
        old = self.loops.pop(model, None)
        if (task := self._tasks.pop(model, None)) is not None:
            task.cancel()
        wake = self.wakers.of(model)
        if wake is not None and (wake.waker is old or isinstance(wake.waker, ReportedDemand)):
            self.wakers.clear(model)  # an [autoscale] table dropped since: no waker of ours
        for name, loop in self.build(model).items():
            self.loops[name] = loop
            if self._tg is not None:
                self._start(name, loop)

    def _start(self, name: str, loop: ScalingLoop) -> None:
        assert self._tg is not None
        self._tasks[name] = self._tg.create_task(loop.run(), name=f"autoscale-{name}")


class ReportedDemand:
    """The waker of a `min_workers = 0` model on a front end that runs no autoscaler (a follower of
    `--frontends N`): the requests it holds are in the load it reports (cluster/load.py: a batch model's
    queue, an LLM model's queued sequences), which the owner's scaling loop adds to its own and scales
    from zero on; nothing here to tell, no start to time."""

    def wakeable(self, model: str, version: int) -> str | None:
        return None

    def wake(self, model: str, version: int, waiting: int, oldest_age_s: float) -> None:
        return None

    def eta_s(self, model: str, version: int) -> float | None:
        return None


class ScalingLoop:
    def __init__(
        self,
        registry: ModelRegistry,
        fleet: FleetControl,
        clock: Clock,
        model: str,
        policy: ScalingPolicy,
        interval_s: float = 1.0,
        others: FrontendLoads | None = None,
        acts: Callable[[], bool] | None = None,
    ) -> None:
        self.registry = registry
        self.fleet = fleet
        self.clock = clock
        self.model = model
        self.autoscaler = policy.autoscaler
        self.observer = policy.observer
        self.interval_s = interval_s
        self.last: Decision | None = None
        self.changes: deque[tuple[float, Decision]] = deque(maxlen=HISTORY)
        """The latest decisions that changed the fleet, with their wall-clock time (for the admin API)."""
        self.others = others
        """The other front ends' reported loads (the owner of several front ends), else None."""
        self.observed: Observed | None = None
        """The latest observation (for the admin API)."""
        self.acts = acts
        """Whether this front end decides now (it holds the lease: cluster/lease.py); None: always."""
        self._woken = asyncio.Event()
        """Set by `wake`: requests are held with no worker (a `min_workers = 0` model): look now."""
        self._starting_since: float | None = None
        """When the latest scale-up from zero was made, until a worker is ready."""
        self.start_s: float | None = None
        """The measured time from a scale-up from zero to a ready worker (the waker's eta); None: none yet."""

    async def run(self) -> None:
        while True:
            await self._pause()
            if self.acts is not None and not self.acts():
                continue  # another front end decides, or the store is down: no change from here
            if self.model not in self.registry:
                continue  # unloaded (fleet/model_control.py): nothing to scale until it is loaded again
            await self.tick()

    async def tick(self) -> None:
        """One look: observe, decide, and change the fleet if the decision says so."""
        self.observed = self.observe()
        self._timed(self.observed.ready_workers)
        if self._gone(self.observed.ready_workers + self.observed.starting_workers):
            self.autoscaler.fleet_gone()
        decision = self.autoscaler.decide(self.observed)
        self.last = decision
        if decision.target_workers != decision.current_workers:
            self.changes.append((time.time(), decision))
            log.info(
                "model %s: %s -> %d workers (%s)",
                self.model,
                decision.current_workers,
                decision.target_workers,
                decision.reason,
            )
            if decision.current_workers == 0:  # timed until a worker is ready (`_timed`)
                self._starting_since = self.clock.now()
            elif decision.target_workers == 0:
                self._starting_since = None
            await self.fleet.scale_to(self.model, decision.target_workers)

    async def _pause(self) -> None:
        """Until the next look: the interval, or sooner when woken (requests held with no worker). While
        a start from zero is timed, whether a worker is ready is checked every START_POLL_S meanwhile."""
        left = self.interval_s
        while left > 0:
            step = left if self._starting_since is None else min(left, START_POLL_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(step):
                    await self._woken.wait()
                    self._woken.clear()
                    return
            left -= step
            if self._starting_since is not None and self.model in self.registry:
                self._timed(self.registry.get(self.model).statistics().ready_workers)

    def _timed(self, ready_workers: int) -> None:
        """A start from zero under way ends when a worker is ready: its time is the eta from now on."""
        if self._starting_since is not None and ready_workers > 0:
            self.start_s = self.clock.now() - self._starting_since
            self._starting_since = None
            log.info("model %s: a worker started from zero in %.2f s", self.model, self.start_s)

    # ---- the waker of a `min_workers = 0` model (runtime/waking.py; kinds/batch/cold.py asks) ----------
    def wakeable(self, model: str, version: int) -> str | None:
        default = self.registry.default_version(model)
        if version != default:
            return f"model '{model}' version {version} has no worker: only its default version {default} scales from zero"
        return None

    def wake(self, model: str, version: int, waiting: int, oldest_age_s: float) -> None:
        """Requests wait with no worker: look now rather than at the end of the interval, unless a worker
        is already planned (one scale-up per need, however often it is called)."""
        if not self.autoscaler.target_workers or self._gone(self.fleet.local_workers(model)):
            self._woken.set()

    def _gone(self, workers: int) -> bool:
        """A `min_workers = 0` model's fleet is at zero beneath its target (an operator scaled it to 0)."""
        return workers == 0 and bool(self.autoscaler.target_workers) and self.autoscaler.config.min_workers == 0

    def eta_s(self, model: str, version: int) -> float | None:
        return self.start_s

    def report(self) -> dict[str, Any]:
        """The autoscaler's state for `inferd status`: its latest decision and its latest changes."""

        def row(d: Decision) -> dict[str, Any]:
            return {"from": d.current_workers, "to": d.target_workers, "reason": d.reason}

        return {
            "last": None if self.last is None else row(self.last),
            "changes": [{"at": round(at, 3), **row(d)} for at, d in self.changes],
            "observed": None if self.observed is None else self.observed.signals(),
        }

    def observe(self) -> Observed:
        stats = self.registry.get(self.model).statistics()
        starting = max(0, self.fleet.local_workers(self.model) - len(stats.workers))
        return self.observer.observe(stats, starting, self.others)
