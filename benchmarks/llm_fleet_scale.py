"""How fast the LLM fleet simulator runs: N devices of the bundled published H100 / Llama-3-8B profile
at the planned 25.84 req/s each (500 + 200 tokens, Poisson), token by token, for D virtual seconds,
behind F front ends (default 1: one front end routing over every device; `inferd plan llm --rps 2584
...` plans 42 for 100 devices); prints the CPU and wall time every 5 virtual seconds, then the report
with the output tokens streamed and the CPU per output token (docs/capacity.md, "Scale").

    .venv/bin/python benchmarks/llm_fleet_scale.py [DEVICES] [SECONDS] [FRONTENDS]    # default 100 60 1
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

from inferd.fleetsim.arrivals import ArrivalSpec, arrival_times
from inferd.fleetsim.llm_fleet import LLMFleet, LLMFleetSpec
from inferd.fleetsim.llm_profile import bundled

PER_DEVICE = 25.84


def main() -> None:
    devices = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    duration = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    frontends = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    times = arrival_times(ArrivalSpec(rate=devices * PER_DEVICE, seed=1), duration)
    n = times.size
    spec = LLMFleetSpec(
        bundled(), devices, times, np.full(n, 500), np.full(n, 200),
        frontends=frontends, warmup_s=10.0, slo={"ttft_ms": 1000.0, "itl_ms": 100.0},
    )  # fmt: skip
    cpu0, wall0 = time.process_time(), time.perf_counter()

    async def run() -> tuple[dict, int]:
        fleet = LLMFleet(spec)

        def progress() -> None:
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            print(json.dumps({"virtual_s": fleet.clock.now(), "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
                              "steps": fleet.steps, "tokens": fleet.step_tokens}), flush=True)  # fmt: skip
            if fleet.clock.now() < duration:
                fleet.events.at(fleet.clock.now() + 5, progress)

        fleet.events.at(5, progress)
        return fleet.run().to_dict(), sum(fleet.tokens)

    report, tokens = asyncio.run(run())
    cpu = time.process_time() - cpu0
    print(json.dumps({"cpu_s": cpu, "wall_s": time.perf_counter() - wall0, "output_tokens": tokens,
                      "cpu_us_per_output_token": round(cpu / max(tokens, 1) * 1e6, 2), **report}))  # fmt: skip


if __name__ == "__main__":
    main()
