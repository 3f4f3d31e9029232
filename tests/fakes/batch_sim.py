"""Drives the real BatchPolicy and RequestQueue on a FakeClock with simulated workers.

Events are processed in time order with a fixed tick, the way the asyncio dispatcher would see them:
arrivals, cancellations, worker completions, and policy wake-ups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.batching.policy import BatchPolicy
from inferd.batching.queue import ItemState, QueuedItem, RequestQueue
from inferd.clock import FakeClock


@dataclass
class SimWorker:
    base_s: float
    per_item_s: float
    running: list[QueuedItem] | None = None
    running_until: float = 0.0
    staged: list[QueuedItem] | None = None

    @property
    def idle(self) -> bool:
        return self.running is None

    @property
    def stage_free(self) -> bool:
        return self.running is not None and self.staged is None


@dataclass
class Outcome:
    answers: dict[int, int] = field(default_factory=dict)  # request id -> times answered
    results: dict[int, object] = field(default_factory=dict)  # request id -> result payload
    batches: list[list[int]] = field(default_factory=list)  # request ids per batch, dispatch order
    waits_while_free: list[float] = field(
        default_factory=list
    )  # extra wait beyond max_wait while a worker was free
    max_depth: int = 0
    dispatched_dead: int = 0
    expired: set[int] = field(default_factory=set)


class BatchingSim:
    def __init__(self, policy: BatchPolicy, queue_size: int, workers: list[SimWorker], tick_s: float = 0.001):
        self.clock = FakeClock()
        self.policy = policy
        self.queue = RequestQueue(queue_size)
        self.workers = workers
        self.tick_s = tick_s
        self.out = Outcome()
        self.items: dict[int, QueuedItem] = {}
        self._wake_at: float | None = None

    # ---- inputs ------------------------------------------------------------------------------------
    def arrive(self, rid: int, deadline_s: float | None = None) -> bool:
        now = self.clock.now()
        if self.queue.free() < 1:
            self._answer(rid, "rejected")
            return False
        item = QueuedItem(rid, now, None if deadline_s is None else now + deadline_s)
        self.items[rid] = item
        self.queue.push(item)
        self.out.max_depth = max(self.out.max_depth, len(self.queue))
        self.step()
        return True

    def cancel(self, rid: int) -> None:
        item = self.items.get(rid)
        if item is not None and self.queue.withdraw(item):
            self._answer(rid, "cancelled")

    # ---- time --------------------------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        end = self.clock.now() + seconds
        while self.clock.now() < end - 1e-12:
            self.clock.advance(min(self.tick_s, end - self.clock.now()))
            self.step()

    def run_until_idle(self, limit_s: float = 120.0) -> None:
        end = self.clock.now() + limit_s
        while (len(self.queue) or any(not w.idle for w in self.workers)) and self.clock.now() < end:
            self.advance(self.tick_s)

    # ---- the driver loop (what ModelRuntime.run does) ----------------------------------------------
    def step(self) -> None:
        now = self.clock.now()
        for w in self.workers:
            self._complete(w, now)
        while True:
            idle = [w for w in self.workers if w.idle]
            staging = [w for w in self.workers if w.stage_free]
            oldest = self.queue.oldest_at()
            d = self.policy.decide(now, len(self.queue), oldest, len(idle), len(staging))
            if not d.size:
                if idle and oldest is not None:
                    late = now - (oldest + self.policy.max_wait_s)
                    self.out.waits_while_free.append(late)
                return
            worker = idle[0] if d.idle else staging[0]
            batch, expired = self.queue.cut(d.size, now)
            for item in expired:
                self.out.expired.add(item.payload)
                self._answer(item.payload, "expired")
            if not batch:
                continue
            if any(i.state is not ItemState.RUNNING for i in batch):
                self.out.dispatched_dead += 1
            self.out.batches.append([i.payload for i in batch])
            if worker.idle:
                worker.running = batch
                worker.running_until = now + worker.base_s + worker.per_item_s * len(batch)
            else:
                worker.staged = batch

    def _complete(self, w: SimWorker, now: float) -> None:
        while w.running is not None and w.running_until <= now + 1e-12:
            for item in w.running:
                item.state = ItemState.DONE
                self._answer(item.payload, ("result", item.payload))
            w.running, w.staged = w.staged, None
            if w.running is not None:
                w.running_until = now + w.base_s + w.per_item_s * len(w.running)

    def _answer(self, rid: int, result: object) -> None:
        self.out.answers[rid] = self.out.answers.get(rid, 0) + 1
        self.out.results[rid] = result
