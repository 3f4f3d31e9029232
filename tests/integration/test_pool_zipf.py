"""A pool under Zipf load, with real processes: 6 pooled `sim` models on a pool of 2 workers with room
for 2 models each, requests drawn Zipf(1.1) over the 6 (seeded) and sent open loop, so that the pool
loads and evicts all along. Every answer must be its own (its id, and the sim digest of its model and
payload); the only refusal allowed is a 429 with a Retry-After; /metrics counts the loads and evictions.
(benchmarks/pool_zipf.py is the measured version: 12 models, 3 per worker.)"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import aiohttp

from inferd.models.sim import sim_digest
from tests.conftest import start_server

MODELS = [f"z{k}" for k in range(1, 7)]
SLOTS = 4  # 2 workers x 2 models

MODEL_TOML = """builtin = "sim"
pool = "p"
memory_mb = 16
max_batch_size = 8
max_wait_ms = 2
default_timeout_ms = 10000

[params]
base_ms = 3
per_item_ms = 0.5
memory_mb = 16
load_ms = 50
"""

POOL_CONFIG = """[pools.p]
workers = 2
memory_budget_mb = 40
max_loaded_models = 2
min_resident_s = 0
"""


def zipf_sequence(n: int, seed: int = 7, s: float = 1.1) -> list[str]:
    weights = [(k + 1) ** -s for k in range(len(MODELS))]
    return random.Random(seed).choices(MODELS, weights=weights, k=n)  # nosec B311  # a test workload


def metric_sum(text: str, name: str) -> dict[str, float]:
    """model -> value of the samples of `name` (summed over their other labels)."""
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) + 1 :].rpartition("} ")
            model = next((p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith("model=")), "")
            out[model] += float(value)
    return dict(out)


async def send(http: aiohttp.ClientSession, url: str, model: str, i: int, delay_s: float) -> tuple[str, str]:
    """(model, verdict): 'ok', 'retry' (a 429 with Retry-After) or what was wrong."""
    await asyncio.sleep(delay_s)
    payload = f"zipf-{i}"
    body = {"id": str(i), "inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": [payload]}]}
    async with http.post(f"{url}/v2/models/{model}/infer", json=body) as r:
        if r.status == 429:
            return model, "retry" if r.headers.get("Retry-After") else "429 without Retry-After"
        if r.status != 200:
            return model, f"{r.status}: {await r.text()}"
        answer = await r.json()
    if answer.get("id") != str(i) or answer["outputs"][0]["data"][0] != sim_digest(model, 1, payload):
        return model, f"not its own answer: {answer}"
    return model, "ok"


async def test_pool_under_zipf_load_loads_and_evicts_and_answers_each_its_own(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for model in MODELS:
        (repo / model / "1").mkdir(parents=True)
        (repo / model / "model.toml").write_text(MODEL_TOML)
    (tmp_path / "inferd.toml").write_text(POOL_CONFIG)
    server = start_server(tmp_path, "--model-repo", str(repo), "--config", str(tmp_path / "inferd.toml"))
    try:
        sequence = zipf_sequence(160)
        rng = random.Random(11)  # nosec B311  # Poisson arrivals at 40/s: 4 s of load
        offsets, t = [], 0.0
        for _ in sequence:
            t += rng.expovariate(40.0)
            offsets.append(t)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            results = await asyncio.gather(
                *(send(http, server.url, m, i, offsets[i]) for i, m in enumerate(sequence))
            )
            async with http.get(f"{server.url}/metrics") as r:
                metrics = await r.text()
    finally:
        server.stop()
    verdicts = Counter(v for _, v in results)
    wrong = [(m, v) for m, v in results if v not in ("ok", "retry")]
    assert not wrong, f"{len(wrong)} answers neither ok nor a 429 with Retry-After: {wrong[:5]}"
    assert verdicts["ok"] >= len(sequence) // 2, verdicts
    served = {m for m, v in results if v == "ok"}
    loads = metric_sum(metrics, "inferd_model_loads_total")
    evictions = metric_sum(metrics, "inferd_model_evictions_total")
    assert all(loads.get(m, 0) >= 1 for m in served), (loads, served)
    assert len(served) > SLOTS, served  # more models served than the pool holds at once
    assert sum(evictions.values()) >= len(served) - SLOTS, (evictions, served)
    held = sum(loads.values()) - sum(evictions.values())  # what the pool holds at the end
    assert 0 <= held <= SLOTS, (loads, evictions)
