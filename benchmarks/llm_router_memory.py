"""What the LLM router's prefix memory costs a front end: one `PrefixAffinityRouter` at the bundled H100
profile's KV pool (25,000 blocks of 16 per worker: the default `remembered_blocks`) sends REQUESTS
prompts of 500 tokens, each with a token no other has (so every block is new), round-robin over WORKERS
workers, as the fleet simulator's 100-device run does. Prints the CPU time of naming each prompt's blocks
(`block_hashes`) and remembering them (`record`), the block names the router then holds and the
process's peak RSS (the interpreter and its imports included: about 100 MB of it).

    .venv/bin/python benchmarks/llm_router_memory.py [WORKERS] [REQUESTS]   # default: 100 100000
"""

from __future__ import annotations

import json
import resource
import sys
import time

from inferd.clock import FakeClock
from inferd.kinds.llm.plan import SchedulerConfig
from inferd.kinds.llm.routing import PrefixAffinityRouter, RoutingConfig


def main() -> None:
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    requests = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
    clock = FakeClock()
    router = PrefixAffinityRouter(RoutingConfig(), SchedulerConfig(block_size=16, num_blocks=25_000), clock)
    filler = list(range(1, 500))
    hashing = remembering = 0.0
    for i in range(requests):
        clock.advance(1 / 2584)  # the simulator's 2,584 req/s
        t0 = time.process_time()
        hashes = router.block_hashes([(i + 1) << 20, *filler], "")
        t1 = time.process_time()
        router.record(f"w{i % workers}", hashes)
        hashing, remembering = hashing + t1 - t0, remembering + time.process_time() - t1
    names = sum(router.remembered(f"w{w}") for w in range(workers))
    print(json.dumps({
        "workers": workers, "requests": requests, "hash_cpu_s": round(hashing, 2),
        "record_cpu_s": round(remembering, 2), "block_names_held": names,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
