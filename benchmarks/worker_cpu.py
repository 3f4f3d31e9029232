"""A worker's own CPU per batch, at batch sizes 1, 10 and 100 (or --sizes): a real worker process
(`python -m inferd.worker.main --model sim`) joined over a Unix socket to a minimal front end in this
process, which speaks the wire protocol (Hello -> Welcome -> Ready, credits), sends RunBatch frames of
`n` items one at a time against the worker's Credit grants, and checks every BatchDone's answers
(sim's digests).

CPU is the worker's on-CPU time from /proc/PID/task/*/schedstat (nanoseconds, every thread: the event
loop and the device thread) over the batches of one size; the idle rate (heartbeats, measured with no
work first) times the window is shown beside it and subtracted in the last column.

    .venv/bin/python benchmarks/worker_cpu.py [--sizes 1,10,100] [--batches 200] [--base-ms 20]
        [--per-item-ms 0.1] [--repeats 3]

`--base-ms 20 --per-item-ms 0.1` (sim's defaults) keep the device's sleeps as in a real server, so the
heartbeats, timers and thread hand-offs that happen while a batch runs are counted; lower them for a
quicker run. Prints a markdown table (best of --repeats per size).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from inferd.models.sim import sim_config, sim_digest
from inferd.wire import protocol as p

TOKEN = "bench"


def on_cpu_ns(pid: int) -> int:
    """Nanoseconds every live thread of `pid` has run (/proc/PID/task/*/schedstat, first field)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total


class FrontEnd:
    """Just enough of a front end for one worker: its handshake, credits and batches."""

    def __init__(self, base_ms: float, per_item_ms: float) -> None:
        self.config = sim_config(base_ms=base_ms, per_item_ms=per_item_ms)
        self.joined: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter, int]] = (
            asyncio.get_running_loop().create_future()
        )

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await p.read_message(reader)
        assert isinstance(hello, p.Hello), hello
        writer.write(
            p.encode_frame(
                p.Welcome(
                    accepted=True,
                    model_config_json=self.config.model_dump_json().encode(),
                    heartbeat_s=1.0,
                    credits=hello.credits,
                )
            )
        )
        ready = await p.read_message(reader)
        assert isinstance(ready, p.Ready), ready
        self.joined.set_result((reader, writer, hello.pid))


class Session:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.credits = 0
        self.batch_id = 0

    async def next_result(self) -> p.BatchDone:
        while True:
            msg = await p.read_message(self.reader)
            if isinstance(msg, p.Credit):
                self.credits += msg.granted
            elif isinstance(msg, p.BatchDone):
                return msg

    async def wait_credit(self) -> None:
        while self.credits < 1:
            msg = await p.read_message(self.reader)
            if isinstance(msg, p.Credit):
                self.credits += msg.granted

    async def run(self, size: int, batches: int) -> None:
        """`batches` batches of `size` items, one at a time, every answer checked."""
        for _ in range(batches):
            await self.wait_credit()
            self.batch_id += 1
            items = [f'{{"batch": {self.batch_id}, "item": {i}, "pad": "{"x" * 24}"}}'.encode() for i in range(size)]
            self.credits -= 1
            self.writer.write(p.encode_frame(p.RunBatch(self.batch_id, items)))
            done = await self.next_result()
            assert done.batch_id == self.batch_id and done.batch_error is None, done
            want = [sim_digest("sim", 1, item) for item in items]
            got = [out["OUTPUT0"] for out in done.outputs]
            got = [g.decode() if isinstance(g, bytes) else g for g in got]
            assert got == want, "a batch came back with answers that are not its own"


async def measure(args: argparse.Namespace) -> dict[int, list[tuple[float, float]]]:
    front = FrontEnd(args.base_ms, args.per_item_ms)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.sock")
        server = await asyncio.start_unix_server(front.accept, path, limit=2**20)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "inferd.worker.main", "--connect", f"unix:{path}", "--model", "sim",
            "--token", TOKEN, "--worker-id", "bench", "--log-level", "WARNING",
        )  # fmt: skip
        try:
            reader, writer, pid = await asyncio.wait_for(front.joined, 30)
            session = Session(reader, writer)
            await session.run(10, 20)  # warm-up
            idle0, t0 = on_cpu_ns(pid), time.monotonic()
            await asyncio.sleep(args.idle_s)
            idle_ns_per_s = (on_cpu_ns(pid) - idle0) / (time.monotonic() - t0)
            results: dict[int, list[tuple[float, float]]] = {}
            for _ in range(args.repeats):
                for size in args.sizes:
                    c0, t0 = on_cpu_ns(pid), time.monotonic()
                    await session.run(size, args.batches)
                    cpu_ns, wall = on_cpu_ns(pid) - c0, time.monotonic() - t0
                    results.setdefault(size, []).append(
                        (cpu_ns / args.batches / 1000, (cpu_ns - idle_ns_per_s * wall) / args.batches / 1000)
                    )
            results[0] = [(idle_ns_per_s / 1e6, 0.0)]
            writer.close()
        finally:
            if proc.returncode is None:
                proc.terminate()
            await proc.wait()
            server.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 10, 100])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base-ms", type=float, default=20.0)
    parser.add_argument("--per-item-ms", type=float, default=0.1)
    parser.add_argument("--idle-s", type=float, default=3.0)
    args = parser.parse_args()
    results = asyncio.run(measure(args))
    idle_ms_per_s = results.pop(0)[0][0]
    print(f"worker idle: {idle_ms_per_s:.2f} ms of CPU per second")
    print(f"| items per batch | worker CPU us/batch (best of {args.repeats}) | less idle | us/item |")
    print("|---:|---:|---:|---:|")
    for size, runs in sorted(results.items()):
        best = min(runs)
        print(f"| {size} | {best[0]:.0f} | {best[1]:.0f} | {best[1] / size:.1f} |")


if __name__ == "__main__":
    main()
