"""`sim`: the simulated device.

A batch of n items costs ``base_ms + per_item_ms * n`` of wall time (one batch at a time per device),
optionally with seeded jitter. Each item's output is a documented deterministic function of its input,
so any client can check it got its own answer:

    OUTPUT0 = sha256(f"{model_name}:{version}:".encode() + INPUT0).hexdigest()[:32]

INPUT0 is one BYTES scalar per item (a JSON string, or raw bytes with the binary extension).
Failure injection (for tests and benchmarks): an input that starts with ``params.fail_prefix``
(default ``"!fail"``) makes the model raise for the whole batch; one that starts with
``params.crash_prefix`` (default ``"!crash"``) kills the worker process mid-batch, as a segfault would.
A slow device (one worker of a fleet): the environment variable ``INFERD_SIM_SLOWDOWN`` of a worker
process multiplies its batch cost (e.g. 10 for a device 10x slower than its peers).
A slow first call (lazy initialization, kernel autotuning): ``params.warmup_ms`` adds that much to the
first batch after load, which is the warm-up (`warmup_inputs`) the worker runs before it takes traffic.
Memory (pools): ``params.memory_mb`` MiB are allocated and touched at load (the worker's resident memory
grows by that much) and freed at unload; ``params.load_ms`` is how long a load takes.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from typing import Any

from inferd.config import ModelConfig, TensorSpec
from inferd.models.base import Model


def sim_digest(model_name: str, version: int, data: bytes | str) -> str:
    """The `sim` model's output for one input."""
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(f"{model_name}:{version}:".encode() + data).hexdigest()[:32]


def sim_config(
    name: str = "sim",
    base_ms: float = 20.0,
    per_item_ms: float = 0.1,
    max_batch_size: int = 100,
    max_wait_ms: float = 10.0,
    **overrides: Any,
) -> ModelConfig:
    params = {"base_ms": base_ms, "per_item_ms": per_item_ms, **overrides.pop("params", {})}
    # About 4 full batches of queue: under overload, accepted requests wait ~120 ms at the default cost
    # and the rest get a fast 429, instead of everyone waiting behind a deep queue.
    overrides.setdefault("max_queue_size", 4 * max_batch_size)
    return ModelConfig(
        name=name,
        implementation="inferd.models.sim:SimModel",
        platform="inferd_sim",
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
        inputs=(TensorSpec(name="INPUT0", datatype="BYTES", shape=()),),
        outputs=(TensorSpec(name="OUTPUT0", datatype="BYTES", shape=()),),
        params=params,
        **overrides,
    )


class SimModel(Model):
    """Costs `base_ms + per_item_ms * n` per batch; answers sim_digest(input)."""

    def load(self) -> None:
        p = self.config.params
        slowdown = float(os.environ.get("INFERD_SIM_SLOWDOWN", "1") or 1)
        self.base_s = slowdown * float(p.get("base_ms", 20.0)) / 1000.0
        self.per_item_s = slowdown * float(p.get("per_item_ms", 0.1)) / 1000.0
        self.jitter = float(p.get("jitter_ratio", 0.0))
        self.fail_prefix = str(p.get("fail_prefix", "!fail")).encode()
        self.crash_prefix = str(p.get("crash_prefix", "!crash")).encode()
        self.rng = random.Random(int(p.get("seed", 0)))  # nosec B311  # simulated jitter, not secrets
        self.prefix = f"{self.config.name}:{self.config.version}:".encode()
        self.first_call_s = float(p.get("warmup_ms", 0.0)) / 1000.0
        size = int(float(p.get("memory_mb", 0.0)) * 2**20)
        # Every page touched, a MiB at a time: one large allocation holds the GIL throughout (about 50 ms
        # per 64 MiB), stalling a pool worker's other models while this one loads beside them.
        self.memory = [bytearray(b"\x01") * min(2**20, size - at) for at in range(0, size, 2**20)]
        time.sleep(float(p.get("load_ms", 0.0)) / 1000.0)

    def unload(self) -> None:
        self.memory = []

    def cost_s(self, n: int) -> float:
        cost = self.base_s + self.per_item_s * n
        if self.jitter:
            cost *= 1.0 + self.rng.uniform(-self.jitter, self.jitter)
        return cost

    def predict_batch(self, inputs: list[bytes]) -> list[str]:
        start = time.perf_counter()
        extra_s, self.first_call_s = self.first_call_s, 0.0  # the first call's cost (warmup_ms), once
        for item in inputs:
            if item.startswith(self.fail_prefix):
                raise ValueError(f"simulated failure on input {item[:40]!r}")
            if item.startswith(self.crash_prefix):
                time.sleep(self.base_s / 2)
                os._exit(70)  # a crash, not an exception: nothing is sent back
        out = [hashlib.sha256(self.prefix + item).hexdigest()[:32] for item in inputs]
        remaining = extra_s + self.cost_s(len(inputs)) - (time.perf_counter() - start)
        if remaining > 0:
            time.sleep(remaining)
        return out

    def warmup_inputs(self) -> list[bytes]:
        return [b"warmup"]
