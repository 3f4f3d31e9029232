"""Models for the pool worker's in-process tests (tests/unit/test_pool_holdings.py): one whose load waits
for the test to let it go, and one that records how many of its batches (of any model) run at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from inferd.models.sim import SimModel

LOAD_GATE = threading.Event()
"""A GatedLoad's load waits for it (set it to let the load end)."""
LOAD_STARTED = threading.Event()
LOADS_STARTED = threading.Semaphore(0)
"""Released once by each GatedLoad whose load has started (its memory taken), waiting for the gate."""


class GatedLoad(SimModel):
    def load(self) -> None:
        super().load()
        LOAD_STARTED.set()
        LOADS_STARTED.release()
        if not LOAD_GATE.wait(30.0):
            raise TimeoutError("the test never let the load end")


class Overlap:
    """Batches running now, across every CountingBatches model, and the most seen at once."""

    lock = threading.Lock()
    now = 0
    most = 0


class CountingBatches(SimModel):
    def predict_batch(self, inputs: list[bytes]) -> list[str]:
        with Overlap.lock:
            Overlap.now += 1
            Overlap.most = max(Overlap.most, Overlap.now)
        try:
            time.sleep(0.02)
            return super().predict_batch(inputs)
        finally:
            with Overlap.lock:
                Overlap.now -= 1


class GatedBatches(SimModel):
    """A batch holding an input that starts with b"gated" runs until the file `params.gate` exists (the
    test lets it end): a pool worker's device stays busy for as long as a test needs, in another process."""

    def predict_batch(self, inputs: list[bytes]) -> list[str]:
        if any(item.startswith(b"gated") for item in inputs):
            gate = Path(self.config.params["gate"])
            deadline = time.monotonic() + 30.0
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().predict_batch(inputs)
