"""Cold admission: a batch model version with no worker in service holds its requests while its waker
(runtime/waking.py: a pool's manager, or the scaling loop of a `min_workers = 0` model) gives it one,
instead of refusing them with a 503. The rule (runtime/cold.py, shared with the llm kind), for a request
of `n` items arriving then:

    no waker registered                  -> 503 "has no ready worker", as for every model without one
    the waker cannot wake it (a reason)  -> 503 with that reason (or the 503 it gave: its Retry-After)
    the cold queue would pass its bound  -> 429, Retry-After = the waker's measured eta (1 s unmeasured)
    the eta is past the request's deadline -> 429, Retry-After = the eta
    else                                 -> admitted: queued as any request is (the normal room and
                                            tenant checks still apply); the waker is told at once, and
                                            again every REWAKE_S while requests wait and no worker serves

The bound is `ModelConfig.cold_queue_size` (default: min(max_queue_size, 4 x max_batch_size)): a
stampede on a cold model is refused at once, not held for a worker that would serve it late. Requests
held past their deadline get the 504 any queued request gets (BatchService's expiry).

The cold start, from the first request held with no worker in service to the first worker in service,
is observed by the runtime (`inferd_cold_start_seconds{model, cause}`), under the cause the waker was
registered with (`Wakers.set(model, waker, cause)`: "scale_from_zero", "pool_load").
"""

from __future__ import annotations

import asyncio
import logging

from inferd.kinds.batch.state import ModelState
from inferd.runtime.cold import REWAKE_S, cold_bound, cold_refusal, waking
from inferd.runtime.waking import Wake, Wakers

log = logging.getLogger("inferd.dispatcher")


class ColdAdmission:
    """One batch model version's cold side: admission while no worker is in service, the waker's
    wake-ups while requests are held (`run`), and the cold start's measure."""

    def __init__(self, state: ModelState, wakers: Wakers | None) -> None:
        self.state = state
        self.wakers = wakers
        self.since: float | None = None
        """When the first request was held with no worker in service (None: not cold, or none held)."""
        self._cause = ""
        self._held = asyncio.Event()
        """Set when a request is held: the re-wake timer runs while requests wait."""

    def wake(self) -> Wake | None:
        """The model's waker (looked up each time: it may be registered after the runtime was built)."""
        return None if self.wakers is None else self.wakers.of(self.state.name)

    def on_demand(self) -> bool:
        """Whether a request arriving with no worker in service would be held (its waker can wake it)."""
        wake = self.wake()
        return wake is not None and wake.waker.wakeable(self.state.name, self.state.config.version) is None

    def check(self, n: int, deadline: float | None) -> None:
        """No worker is in service: raise WorkerUnavailable (no waker, or it cannot wake the model) or
        Overloaded (the cold rule), or return: `n` items may be held."""
        state, config = self.state, self.state.config
        wake = waking(self.wake(), state.name, config.version)
        bound = cold_bound(config.cold_queue_size, config.max_queue_size, config.max_batch_size)
        eta = wake.waker.eta_s(state.name, config.version)
        refusal = cold_refusal(state.name, len(state.queue), n, bound, state.clock.now(), deadline, eta)
        if refusal is not None:
            raise refusal

    def held(self) -> None:
        """Requests were just queued with no worker in service: the cold start begins (if it had not),
        and the waker is told."""
        wake = self.wake()
        if wake is None:
            return
        oldest = self.state.queue.oldest_at()
        if self.since is None:
            self.since, self._cause = self.state.clock.now(), wake.cause
        elif oldest is not None and oldest > self.since:  # every request held before was answered
            self.since, self._cause = oldest, wake.cause  # (expired, withdrawn): it starts again
        self._tell(wake)
        self._held.set()

    def served(self) -> None:
        """A worker is in service: the cold start, if one was under way, ended now."""
        if self.since is None or self.state.ready_workers() == 0:
            return
        self.state.metrics.cold_started(self._cause, self.state.clock.now() - self.since)
        self.since = None

    def held_for_s(self) -> float | None:
        """How long the cold start under way has held requests (None: none under way, or none held now)."""
        if self.since is None or not self.holding():
            return None
        return self.state.clock.now() - self.since

    def failed(self) -> None:
        """The waker gave up (a failed load): the held requests were answered; the next cold start is
        measured afresh."""
        self.since = None

    def holding(self) -> bool:
        """Requests wait and no worker is in service."""
        return len(self.state.queue) > 0 and self.state.ready_workers() == 0

    async def run(self) -> None:
        """Tell the waker again every REWAKE_S while requests are held, until cancelled."""
        while True:
            await self._held.wait()
            while self.holding():
                wake = self.wake()
                if wake is not None:
                    self._tell(wake)
                await asyncio.sleep(REWAKE_S)
            self._held.clear()

    def _tell(self, wake: Wake) -> None:
        """Tell the waker what waits. Its failure is logged, never raised: the requests are queued
        already (their callers wait on them), and they stay held until a worker comes or they expire."""
        queue = self.state.queue
        oldest_at = queue.oldest_at()
        age = 0.0 if oldest_at is None else self.state.clock.now() - oldest_at
        try:
            wake.waker.wake(self.state.name, self.state.config.version, len(queue), age)
        except Exception:
            log.exception("the waker of model %s failed; its held requests wait", self.state.name)
