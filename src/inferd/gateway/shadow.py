"""Shadow traffic: a sampled copy of a model's requests also runs on another served version, and its
answer is compared with the primary's, never returned.

    [models.sim.traffic]
    shadow = { version = 2, fraction = 0.2 }

Routes: OIP infer (outputs compared tensor by tensor, `same_outputs`) and OpenAI /v1/embeddings
(vectors compared, api/openai.py). A route asks `target(rt)` once it has the primary's answer, and
hands `mirror` that answer, how to run the copy (`copy_items` runs the request's items through the
shadow version's BatchService, kinds/batch/service.py) and how to compare the two. Text generation has
no shadow: its answers are token streams of a different runtime kind, and only deterministic ones could
be compared at all.

The copy starts after the primary has answered, as a task of its own that the primary's response never
waits for. It goes through no layer of the request chain: it is never cached, never charged to the
tenant, and it is queued at bulk priority, so an overloaded queue sheds it before any caller's work.
Its deadline is its own (`timeout_s` from when it starts): past it, the copy's items expire and it counts
as an error; whatever the copy meets never reaches the primary's caller.
At most `max_in_flight` copies run at once (ServerConfig.shadow_max_in_flight); one over the budget is
dropped. Each copy is counted in inferd_shadow_requests_total{model, version, result}, result one of
same / different / error / dropped. `close()` cancels the copies still running (server shutdown).

`ShadowSampler` and `ShadowBudget` are the policy: plain objects, no I/O, no clock needed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import numpy as np
from prometheus_client import Counter

from inferd.clock import Clock, MonotonicClock
from inferd.errors import ServingError
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.routing.fairness import BULK
from inferd.runtime.contract import Runtime
from inferd.runtime.registry import ModelRegistry

log = logging.getLogger("inferd.shadow")

DEFAULT_MAX_IN_FLIGHT = 64
DEFAULT_TIMEOUT_S = 30.0
"""How long one copy may take before it expires (DeadlineExceeded) and is counted as an error."""

T = TypeVar("T")
Rows = list[dict[str, Any]]


class ShadowSampler:
    """Picks the requests to copy: exactly `fraction` of them over any run of requests, spread evenly
    and deterministically (a credit that grows by `fraction` per request and pays 1 per copy)."""

    def __init__(self, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"shadow fraction {fraction} must be in (0, 1]")
        self.fraction = fraction
        self._credit = 0.0

    def sample(self) -> bool:
        self._credit += self.fraction
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False


class ShadowBudget:
    """At most `limit` copies in flight; a copy over it is dropped, not queued."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"shadow budget {limit} must be >= 0")
        self.limit = limit
        self.in_flight = 0

    def try_acquire(self) -> bool:
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        if self.in_flight <= 0:
            raise RuntimeError("shadow budget released more often than acquired")
        self.in_flight -= 1


def same_outputs(primary: list[dict[str, Any]], shadow: list[dict[str, Any]]) -> bool:
    """Per-item outputs equal, name by name and value by value (arrays element-wise)."""
    if len(primary) != len(shadow):
        return False
    for a, b in zip(primary, shadow, strict=True):
        if a.keys() != b.keys():
            return False
        for name, value in a.items():
            try:
                if not np.array_equal(np.asarray(value), np.asarray(b[name])):
                    return False
            except (TypeError, ValueError):
                return False
    return True


class Shadows:
    """The copies of one front end: sampling per model, the shared budget, the running tasks."""

    def __init__(
        self,
        registry: ModelRegistry,
        counter: Counter,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Clock | None = None,
    ) -> None:
        self.registry = registry
        self.clock = clock or MonotonicClock()
        self.counter = counter
        self.budget = ShadowBudget(max_in_flight)
        self.timeout_s = timeout_s
        self._samplers: dict[str, ShadowSampler] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def target(self, primary: Runtime) -> Runtime | None:
        """The version to copy this request to, if this one is sampled: the model's default version's
        traffic table names it, it is served, and it is not the version that answered."""
        shadow = self.registry.get(primary.name).config.traffic.shadow
        if shadow is None or shadow.version == primary.version or self._closed:
            return None
        if shadow.version not in self.registry.versions(primary.name):
            return None
        sampler = self._samplers.get(primary.name)
        if sampler is None or sampler.fraction != shadow.fraction:
            sampler = self._samplers[primary.name] = ShadowSampler(shadow.fraction)
        if not sampler.sample():
            return None
        return self.registry.get(primary.name, shadow.version)

    def mirror(
        self,
        shadow: Runtime,
        primary: T,
        run: Callable[[Runtime, float], Awaitable[T]],
        same: Callable[[T, T], bool] = same_outputs,  # type: ignore[assignment]
    ) -> None:
        """Start `run(shadow, timeout_s)` as a task of its own, and compare its answer with the primary's
        (`same(primary, copy)`, by default OIP rows) when it ends. Returns at once; over the budget the
        copy is dropped."""
        labels = (shadow.name, str(shadow.version))
        if not self.budget.try_acquire():
            self.counter.labels(*labels, "dropped").inc()
            return
        task = asyncio.get_running_loop().create_task(
            self._run(labels, lambda: run(shadow, self.timeout_s), lambda copy: same(primary, copy)),
            name=f"shadow-{shadow.name}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        """Every task ends here once, even one cancelled before it began."""
        self._tasks.discard(task)
        self.budget.release()

    async def copy_items(self, payloads: list[Any], rt: Runtime, timeout_s: float) -> Rows:
        """The outputs of a request's items run on `rt` (a batch runtime: another version of the batch
        model that answered) at bulk priority (shed first), through its service, which expires them after
        `timeout_s`; no cache, no quota, no client connection."""
        service = cast(ModelRuntime, rt).service
        results = await service.infer(payloads, deadline=self.clock.now() + timeout_s, priority=BULK)
        return [r.outputs for r in results]

    async def _run(
        self,
        labels: tuple[str, str],
        copy: Callable[[], Awaitable[T]],
        same: Callable[[T], bool],
    ) -> None:
        try:
            verdict = "same" if same(await copy()) else "different"
        except ServingError as exc:
            log.debug("shadow copy on %s v%s failed: %s", *labels, exc.message)
            verdict = "error"
        except Exception:
            log.exception("shadow copy on %s v%s failed", *labels)
            verdict = "error"
        self.counter.labels(*labels, verdict).inc()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def settle(self) -> None:
        """Returns once every copy running now has ended."""
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel every copy still running and wait for them (server shutdown); no new ones start."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
