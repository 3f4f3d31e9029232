"""How fast the LLM fleet simulator runs: N devices of the bundled published H100 / Llama-3-8B profile
at the planned 25.84 req/s each (500 + 200 tokens, Poisson), token by token, for D virtual seconds,
behind F front ends (default 1: one front end routing over every device; `inferd plan llm --rps 2584
...` plans 42 for 100 devices); prints the CPU and wall time every 5 virtual seconds, then the report
with the output tokens streamed, the CPU per output token (docs/capacity.md, "Scale") and how evenly the
devices were loaded: min / mean / max over devices of engine steps, sequences finished and busy seconds,
and, sampled every 0.5 virtual seconds of the measured window, the sequences each engine holds (running +
waiting): the mean over samples of the most minus the fewest, and of the most over the mean.
With `shared` every device serves every front end (as `inferd worker --connect a,b,...`; the default
gives each front end its own devices), and the spread also has, per device, the largest share of its
sequences that one front end placed (docs/fleet-sim.md, "LLM devices shared by every front end").
SEED seeds the arrival times (default 1).

    .venv/bin/python benchmarks/llm_fleet_scale.py [DEVICES] [SECONDS] [FRONTENDS] [shared|partitioned] [SEED]
    # default: 100 60 1 partitioned 1
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

from inferd.fleetsim.arrivals import ArrivalSpec, arrival_times
from inferd.fleetsim.llm_fleet import LLMFleet, LLMFleetSpec
from inferd.fleetsim.llm_links import SharedLLMDevice
from inferd.fleetsim.llm_profile import bundled

PER_DEVICE = 25.84


def main() -> None:
    devices = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    duration = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    frontends = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    shared = len(sys.argv) > 4 and sys.argv[4] == "shared"
    seed = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    times = arrival_times(ArrivalSpec(rate=devices * PER_DEVICE, seed=seed), duration)
    n = times.size
    spec = LLMFleetSpec(
        bundled(), devices, times, np.full(n, 500), np.full(n, 200),
        frontends=frontends, warmup_s=10.0, slo={"ttft_ms": 1000.0, "itl_ms": 100.0}, shared_devices=shared,
    )  # fmt: skip
    cpu0, wall0 = time.process_time(), time.perf_counter()

    async def run() -> tuple[dict, int, dict]:
        fleet = LLMFleet(spec)

        def progress() -> None:
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            print(json.dumps({"virtual_s": fleet.clock.now(), "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
                              "steps": fleet.steps, "tokens": fleet.step_tokens}), flush=True)  # fmt: skip
            if fleet.clock.now() < duration:
                fleet.events.at(fleet.clock.now() + 5, progress)

        fleet.events.at(5, progress)
        held = Held(fleet, duration)
        fleet.events.at(spec.warmup_s, held.sample)
        return fleet.run().to_dict(), sum(fleet.tokens), {**spread(fleet), **held.summary()}

    report, tokens, devices_spread = asyncio.run(run())
    cpu = time.process_time() - cpu0
    print(json.dumps({"cpu_s": cpu, "wall_s": time.perf_counter() - wall0, "output_tokens": tokens,
                      "cpu_us_per_output_token": round(cpu / max(tokens, 1) * 1e6, 2), **report}))  # fmt: skip
    print(json.dumps({"shared_devices": shared, "devices": devices_spread}))


def spread(fleet: LLMFleet) -> dict[str, list[float]]:
    """Per device: [min, mean, max] over the devices."""
    per_device: dict[str, list[float]] = {"steps": [], "sequences_finished": [], "busy_s": []}
    for device in fleet.devices:
        stats = device.scheduler.statistics()
        per_device["steps"].append(stats.steps)
        per_device["sequences_finished"].append(stats.finished)
        per_device["busy_s"].append(device.connections()[0][1].busy_s)  # every link sees every step
        if isinstance(device, SharedLLMDevice):
            added = [link.added for link in device.all_links]
            per_device.setdefault("top_frontend_share", []).append(max(added) / max(sum(added), 1))
    return {k: [round(min(v), 3), round(sum(v) / len(v), 3), round(max(v), 3)] for k, v in per_device.items()}


class Held:
    """The sequences each engine holds, sampled every 0.5 virtual seconds until `end`."""

    def __init__(self, fleet: LLMFleet, end: float) -> None:
        self.fleet = fleet
        self.end = end
        self.gaps: list[int] = []
        self.ratios: list[float] = []

    def sample(self) -> None:
        held = [s.running + s.waiting for s in (d.scheduler.statistics() for d in self.fleet.devices)]
        mean = sum(held) / len(held)
        self.gaps.append(max(held) - min(held))
        self.ratios.append(max(held) / mean if mean else 1.0)
        if self.fleet.clock.now() + 0.5 < self.end:
            self.fleet.events.at(self.fleet.clock.now() + 0.5, self.sample)

    def summary(self) -> dict[str, float]:
        n = max(len(self.gaps), 1)
        return {
            "held_max_minus_min": round(sum(self.gaps) / n, 2),
            "held_max_over_mean": round(sum(self.ratios) / n, 3),
        }


if __name__ == "__main__":
    main()
