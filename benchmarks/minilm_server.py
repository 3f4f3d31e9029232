"""minilm through the server: sentences/s with batching (max_batch_size 32) vs without (1).

Closed-loop: --clients concurrent callers each send one sentence per OIP request, as fast as answers
come back, for --duration seconds after a warm-up; the server runs one worker. The only thing that
differs between the two runs is max_batch_size.

    .venv/bin/python benchmarks/minilm_server.py [--clients 32] [--duration 10]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import aiohttp
from harness import OUT_DIR, InferdServer, write_json

SENTENCES = [
    f"sentence number {i}: inference servers batch requests to use the device well" for i in range(64)
]


def server(port: int, max_batch: int) -> InferdServer:
    """`inferd serve` with one minilm worker and this max_batch_size."""
    config = f"[models.minilm]\nmax_batch_size = {max_batch}\nmax_queue_size = 1024\n"
    serve = ("--model", "minilm", "--no-admin", "--log-level", "WARNING")
    return InferdServer(
        *serve,
        name=f"minilm_server_{max_batch}",
        config=config,
        port=port,
        ready_timeout_s=60.0,
        grace_s=30.0,
    )


async def drive(port: int, clients: int, duration: float, warmup: float) -> dict:
    url = f"http://127.0.0.1:{port}/v2/models/minilm/infer"
    done: list[float] = []
    sizes: list[int] = []
    stop_at = time.monotonic() + warmup + duration
    measure_from = time.monotonic() + warmup

    async def client(n: int, http: aiohttp.ClientSession) -> None:
        i = n
        while time.monotonic() < stop_at:
            text = SENTENCES[i % len(SENTENCES)]
            i += clients
            body = {
                "inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [text]}],
                "outputs": [{"name": "TOKENS"}],
            }
            t0 = time.monotonic()
            async with http.post(url, json=body) as r:
                await r.read()
                assert r.status == 200, r.status
                if t0 >= measure_from:
                    done.append(time.monotonic() - t0)
                    sizes.append(int(r.headers["x-inferd-batch-size"]))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as http:
        await asyncio.gather(*(client(n, http) for n in range(clients)))
    done.sort()
    return {
        "sentences_per_s": round(len(done) / duration, 1),
        "p50_ms": round(1000 * done[len(done) // 2], 1),
        "p99_ms": round(1000 * done[int(len(done) * 0.99)], 1),
        "mean_batch": round(sum(sizes) / len(sizes), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--port", type=int, default=8391)
    args = ap.parse_args()
    results = {}
    for max_batch in (1, 32):
        with server(args.port, max_batch) as srv:
            results[max_batch] = asyncio.run(drive(srv.port, args.clients, args.duration, args.warmup))
        print(f"max_batch_size={max_batch}: {results[max_batch]}")
    gain = results[32]["sentences_per_s"] / results[1]["sentences_per_s"]
    print(f"batching gain through the server ({args.clients} concurrent callers): {gain:.2f}x")
    write_json(
        OUT_DIR / "minilm_server.json", {"results": results, "gain": gain, "command": " ".join(sys.argv)}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
