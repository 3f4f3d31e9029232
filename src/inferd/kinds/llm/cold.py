"""The cold hold of an LLM model version: with no worker in service and a waker (runtime/waking.py: the
scaling loop of a `min_workers = 0` model), a request's sequences wait, within its deadline, for a worker
instead of a 503; the cold rule (runtime/cold.py, the batch kind's too) decides at once whether they may:

    no waker, or it cannot wake the model  -> 503 (the reason when it gives one)
    past the bound, or eta past deadline   -> 429 with Retry-After = the measured eta (1 s unmeasured)
    else                                   -> held: the waker is told at once and every REWAKE_S while
                                              sequences are held (`rewake`, the runtime's watchdog calls it)

The unit held is a sequence (a request of `n` choices holds `n`). The bound is four full sets of the
engine's seats (4 x `params.scheduler.max_num_seqs`) within one engine's waiting room (`max_waiting_seqs`:
a first worker queues every held sequence at once): `cold_bound` as the batch kind's default, with seats
for a batch and the waiting room for the queue (`cold_queue_size` is a batch-model setting).

A held request leaves the hold when a worker is in service (`served`, from `add_worker`: the service then
places its sequences as any request's), when its deadline passes (DeadlineExceeded, 504), or, with no
deadline (text generation has none by default), after the model's `default_timeout_ms` (503: no worker
came); cancelled (the caller left), it leaves at once. The held sequences are the model's demand while
no worker serves (`LLMRuntimeStatistics.held`: the scaling loop scales up from zero on them). The cold
start, from the first sequence held to the first worker in service, is observed in
`inferd_cold_start_seconds{model, cause}` under the waker's cause.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from inferd.clock import Clock
from inferd.config import ModelConfig
from inferd.errors import DeadlineExceeded, ServingError, WorkerUnavailable
from inferd.observability.metrics import LLMMetrics
from inferd.runtime.cold import REWAKE_S, cold_bound, cold_refusal, waking
from inferd.runtime.waking import Wake, Wakers

log = logging.getLogger("inferd.llm")


class ColdHold:
    """One LLM model version's cold side: whether a request is held, the wait for a worker, the waker's
    wake-ups while sequences are held, and the cold start's measure."""

    def __init__(
        self,
        config: Callable[[], ModelConfig],
        clock: Clock,
        wakers: Wakers | None,
        ready_workers: Callable[[], int],
        max_waiting_seqs: int,
        max_num_seqs: int,
        metrics: LLMMetrics | None = None,
    ) -> None:
        self._config = config
        self.clock = clock
        self.wakers = wakers
        self._ready_workers = ready_workers
        self.max_waiting_seqs = max_waiting_seqs
        self.max_num_seqs = max_num_seqs
        self.metrics = metrics
        self.held = 0
        """Sequences waiting for a worker now."""
        self.since: float | None = None
        """When the first sequence was held with no worker in service (None: no cold start under way)."""
        self._cause = ""
        self._told_at: float | None = None
        self._served = asyncio.Event()
        """Set (and replaced) when a worker comes into service: every held request stops waiting."""
        self._failure: ServingError | None = None
        """Why no request is held any more (the model stops): the held ones fail with it."""

    @property
    def bound(self) -> int:
        return cold_bound(None, self.max_waiting_seqs, self.max_num_seqs)

    def wake(self) -> Wake | None:
        """The model's waker (looked up each time: it may be registered after the runtime was built)."""
        config = self._config()
        return None if self.wakers is None else self.wakers.of(config.name)

    def on_demand(self) -> bool:
        """Whether a request arriving with no worker in service would be held (its waker can wake it)."""
        wake, config = self.wake(), self._config()
        return wake is not None and wake.waker.wakeable(config.name, config.version) is None

    async def wait(self, n: int, deadline: float | None) -> None:
        """Return once a worker is in service (at once when one is). With none: hold the request's `n`
        sequences until one is, or raise at once what the cold rule says (WorkerUnavailable, Overloaded),
        or DeadlineExceeded / WorkerUnavailable when the wait ends without a worker."""
        if self._failure is not None:
            raise self._failure
        if self._ready_workers() > 0:
            return
        config = self._config()
        wake = waking(self.wake(), config.name, config.version)
        now = self.clock.now()
        eta = wake.waker.eta_s(config.name, config.version)
        refusal = cold_refusal(config.name, self.held, n, self.bound, now, deadline, eta)
        if refusal is not None:
            raise refusal
        if self.since is None:
            self.since, self._cause = now, wake.cause
        served = self._served
        self.held += n
        try:
            self._tell(wake)
            limit_s = self._limit_s(config, deadline, now)
            try:
                async with asyncio.timeout(limit_s):
                    await served.wait()
            except TimeoutError:
                raise self._timed_out(config, deadline, now) from None
        finally:
            self.held -= n
            if self.held == 0 and self._ready_workers() == 0:
                self.since = None  # every held request left without a worker: the next cold start is afresh
        if self._failure is not None:
            raise self._failure

    def fail(self, exc: ServingError) -> None:
        """The model stops (server shutdown): every held request fails with `exc`, and none is held again."""
        self._failure = exc
        served, self._served = self._served, asyncio.Event()
        served.set()

    def served(self) -> None:
        """A worker came into service: the held requests go on, and the cold start, if one was under way,
        ended now."""
        if self._ready_workers() == 0:
            return
        served, self._served = self._served, asyncio.Event()
        served.set()
        if self.since is not None and self.metrics is not None:
            self.metrics.cold_started(self._cause, self.clock.now() - self.since)
        self.since = None

    def rewake(self) -> None:
        """While sequences are held and no worker serves, tell the waker again every REWAKE_S (called
        more often: by the runtime's watchdog)."""
        if self.held == 0 or self._ready_workers() > 0:
            return
        if self._told_at is not None and self.clock.now() - self._told_at < REWAKE_S:
            return
        wake = self.wake()
        if wake is not None:
            self._tell(wake)

    def held_for_s(self) -> float | None:
        """How long the cold start under way has held requests (None: none under way)."""
        return None if self.since is None else self.clock.now() - self.since

    def _tell(self, wake: Wake) -> None:
        """Tell the waker what waits. Its failure is logged, never raised: the requests stay held until a
        worker comes or their wait ends."""
        config = self._config()
        now = self.clock.now()
        self._told_at = now
        age = 0.0 if self.since is None else now - self.since
        try:
            wake.waker.wake(config.name, config.version, self.held, age)
        except Exception:
            log.exception("the waker of model %s failed; its held requests wait", config.name)

    @staticmethod
    def _limit_s(config: ModelConfig, deadline: float | None, now: float) -> float | None:
        if deadline is not None:
            return max(0.0, deadline - now)
        return None if config.default_timeout_ms is None else config.default_timeout_ms / 1000.0

    @staticmethod
    def _timed_out(config: ModelConfig, deadline: float | None, held_at: float) -> Exception:
        if deadline is not None:
            return DeadlineExceeded(
                f"request to model '{config.name}' missed its deadline after {1000 * (deadline - held_at):.0f} ms "
                "waiting for a worker to start"
            )
        return WorkerUnavailable(
            f"model '{config.name}' had no worker in service within {config.default_timeout_ms:.0f} ms "
            "(its default_timeout_ms) of this request; retry shortly"
        )
