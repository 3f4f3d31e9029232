"""What happens to a batch that failed: retry, isolate, or fail its callers. A plain object, no I/O.

* A crash or hang of a batch of several items re-runs it in halves (separate batches), narrowing down to
  an input that crashes the worker every time; isolation rounds are bounded by log2 of the batch size,
  spend no retry budget, and count against each request's deadline.
* A single item that crashed in its batch and again on its own is the poison input: its caller gets a
  ModelError naming the failure; nobody else does.
* A single item that crashed without having been isolated is retried under the global retry budget,
  at most `max_attempts` runs in all.
* A model exception is deterministic for its input: the batch is isolated the same way, and the
  isolated failing input is answered with the model's error, never retried.
* A model that is not idempotent is never run twice: its callers get WorkerDied.
* Batches staged behind the running one on a lost worker go back to the queue, their attempt not counted:
  a crashed worker never started them. A worker cut off by the network may have run them all, though, so
  for a model that is not idempotent they fail like the running batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from inferd.errors import ModelError, ServingError, WorkerDied
from inferd.kinds.batch.queue import QueuedItem
from inferd.routing.retry import RetryBudget


class FailureKind(enum.Enum):
    CRASH = "crash"
    HANG = "hang"
    MODEL_ERROR = "model_error"


@dataclass(slots=True)
class RecoveryPlan:
    retry: list[QueuedItem] = field(default_factory=list)
    """Back to the head of the queue, in their original order."""
    isolate: list[list[QueuedItem]] = field(default_factory=list)
    """Groups to run as batches of their own, ahead of the queue."""
    requeue: list[QueuedItem] = field(default_factory=list)
    """Back to the head of the queue, in their original order, as never run (not counted as retries)."""
    fail: list[tuple[QueuedItem, ServingError]] = field(default_factory=list)
    budget_exhausted: bool = False


class RecoveryPolicy:
    def __init__(self, model: str, budget: RetryBudget, idempotent: bool, max_attempts: int = 3) -> None:
        self.model = model
        self.budget = budget
        self.idempotent = idempotent
        self.max_attempts = max_attempts

    def on_failure(self, items: list[QueuedItem], kind: FailureKind, detail: str) -> RecoveryPlan:
        """`items`: the failed batch's items whose callers are still waiting, in batch order."""
        plan = RecoveryPlan()
        if not items:
            return plan
        if kind is FailureKind.MODEL_ERROR:
            return self._model_error(items, detail, plan)
        for item in items:
            item.crashes += 1
        if not self.idempotent:
            err = (
                f"the worker running this request's batch failed ({detail}); model '{self.model}' is not "
                "idempotent, so it is not retried"
            )
            plan.fail = [(item, WorkerDied(err)) for item in items]
            return plan
        if len(items) > 1:
            plan.isolate = _halves(items)
            return plan
        (item,) = items
        if item.crashes >= 2 and item.isolation_round > 0:
            plan.fail.append(
                (
                    item,
                    ModelError(
                        f"this input crashed model '{self.model}' {item.crashes} times, the last time alone in its "
                        f"batch ({detail}); it was isolated as the cause and is not retried"
                    ),
                )
            )
        elif item.attempts >= self.max_attempts:
            plan.fail.append(
                (
                    item,
                    WorkerDied(
                        f"the worker failed while running this request ({detail}); gave up after {item.attempts} "
                        "attempts"
                    ),
                )
            )
        elif self.budget.try_spend(1):
            plan.retry.append(item)
        else:
            plan.budget_exhausted = True
            plan.fail.append(
                (
                    item,
                    WorkerDied(
                        f"the worker failed while running this request ({detail}); the retry budget is exhausted"
                    ),
                )
            )
        return plan

    def on_staged_lost(self, items: list[QueuedItem], detail: str) -> RecoveryPlan:
        """`items`: the unanswered items of the batches a lost worker held behind its running one."""
        plan = RecoveryPlan()
        if self.idempotent:
            for item in items:
                item.attempts -= 1  # sent, maybe never run: not an attempt
            plan.requeue = items
            return plan
        err = (
            f"the worker holding this request's batch was lost ({detail}) and may have run it; model "
            f"'{self.model}' is not idempotent, so it is not retried"
        )
        plan.fail = [(item, WorkerDied(err)) for item in items]
        return plan

    def _model_error(self, items: list[QueuedItem], detail: str, plan: RecoveryPlan) -> RecoveryPlan:
        if len(items) > 1:
            plan.isolate = _halves(items)
        else:
            plan.fail.append((items[0], ModelError(detail)))
        return plan


def _halves(items: list[QueuedItem]) -> list[list[QueuedItem]]:
    mid = (len(items) + 1) // 2
    groups = [items[:mid], items[mid:]]
    for group in groups:
        for item in group:
            item.isolation_round += 1
    return groups
