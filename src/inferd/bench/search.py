"""`inferd bench-search`: quality and open-loop load against a running server's search API.

1. Quality (when qrels are given): every judged query once, k = 100, closed loop; nDCG@10 and Recall@100
   of the answers (kinds/search/quality.py's metrics).
2. Load: Poisson arrivals at `rate` for `duration_s`, fixed before the run (a slow server does not slow
   the sender: latency counts from the intended send time); queries drawn from the file in order.
   Latencies go to an HDR histogram; every answer's status, coverage and degraded flags are counted.
3. Faults (local servers): at `kill_at_s` one replica of shard 0 is SIGKILLed; at `slow_at_s` one is
   stopped (SIGSTOP) for `slow_s` seconds, then resumed; with `slow_factor` F it is instead slowed F
   times for `slow_s` seconds: stopped and resumed every 50 ms so that it runs 1/F of the time.
4. Caches: `result_cache=False` asks every search to skip the result cache (`"cache": false`; query
   vectors stay cached); `fresh_queries` makes every search's text unique (a token no document holds is
   appended), so each one is embedded: the uncached cost.

The report is JSON (--out saves it). `inferd plan search` reads a shard profile instead (shard_profile.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
from hdrh.histogram import HdrHistogram

from inferd.bench.http_clients import RawClient
from inferd.kinds.search.quality import Qrels, ndcg_at, recall_at


@dataclass(frozen=True)
class BenchSpec:
    url: str
    index: str
    queries: list[tuple[str, str]]
    qrels: Qrels
    rate: float = 50.0
    duration_s: float = 10.0
    k: int = 10
    mode: str = "hybrid"
    timeout_ms: float = 1000.0
    seed: int = 0
    kill_at_s: float | None = None
    slow_at_s: float | None = None
    slow_s: float = 2.0
    slow_factor: float | None = None
    result_cache: bool = True
    fresh_queries: bool = False


@dataclass
class BenchReport:
    index: str
    mode: str
    rate: float
    duration_s: float
    sent: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    partial: int = 0
    degraded: int = 0
    latency_ms: dict[str, float] = field(default_factory=dict)
    achieved_qps: float = 0.0
    quality: dict[str, float] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)
    hedge: dict[str, float] = field(default_factory=dict)
    """Shard requests and hedges during the load (from the index's counters)."""
    index_state: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


class Coverage(msgspec.Struct):
    shards: int = 0
    answered: int = 0


class Answer(msgspec.Struct):
    """What the load counts of a search's answer (the hits are skipped, not decoded)."""

    coverage: Coverage = msgspec.field(default_factory=Coverage)
    degraded: list[str] = []


_answer = msgspec.json.Decoder(Answer)
_body = msgspec.json.Encoder()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_queries(path: Path) -> list[tuple[str, str]]:
    return [(str(q["id"]), q["text"]) for q in read_jsonl(path)]


def read_qrels(path: Path) -> Qrels:
    qrels: Qrels = {}
    for j in read_jsonl(path):
        qrels.setdefault(str(j["query_id"]), {})[str(j["doc_id"])] = int(j["relevance"])
    return qrels


async def run_bench(spec: BenchSpec) -> BenchReport:
    report = BenchReport(spec.index, spec.mode, spec.rate, spec.duration_s)
    base = f"{spec.url.rstrip('/')}/v1/indexes/{spec.index}"
    timeout = aiohttp.ClientTimeout(total=spec.timeout_ms / 1000 + 30)
    # No cookie jar: the API sets none, and every response would be scanned for them.
    async with aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()) as http:
        await until_applied(http, base)
        if spec.qrels:
            report.quality = await quality(http, base, spec)
        before = await state(http, base)
        await load(http, base, spec, report)
        report.index_state = await state(http, base)
        requests = report.index_state["hedge"]["requests"] - before["hedge"]["requests"]
        hedges = report.index_state["hedge"]["hedges"] - before["hedge"]["hedges"]
        report.hedge = {"requests": requests, "hedges": hedges, "share": hedges / max(1, requests)}
    return report


async def state(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with http.get(base) as r:
        return await r.json()


async def until_applied(http: aiohttp.ClientSession, base: str, timeout_s: float = 600.0) -> None:
    """Until every shard's replicas applied its whole log (measure the index, not a replica catching up)."""
    async with asyncio.timeout(timeout_s):
        while True:
            async with http.get(base) as r:
                state = await r.json()
            if r.status != 200:
                raise RuntimeError(f"index state: {r.status} {state}")
            if state["applied_seq"] == state["seq"]:
                return
            await asyncio.sleep(0.5)


async def quality(http: aiohttp.ClientSession, base: str, spec: BenchSpec) -> dict[str, float]:
    """nDCG@10 and Recall@100 over the judged queries (relevance <= 0 is not relevant)."""
    judged = [(q, text) for q, text in spec.queries if any(r > 0 for r in spec.qrels.get(q, {}).values())]
    ndcg, recall = [], []
    for qid, text in judged:
        body = {"query": text[:4096], "k": 100, "mode": spec.mode, "timeout_ms": max(spec.timeout_ms, 5000)}
        async with http.post(f"{base}/search", json=body) as r:
            answer = await r.json()
        ranked = [h["id"] for h in answer.get("hits", [])]
        ndcg.append(ndcg_at(ranked, spec.qrels[qid], 10))
        recall.append(recall_at(ranked, spec.qrels[qid], 100))
    n = len(judged)
    return {"queries": n, "ndcg@10": sum(ndcg) / n if n else 0.0, "recall@100": sum(recall) / n if n else 0.0}


async def load(http: aiohttp.ClientSession, base: str, spec: BenchSpec, report: BenchReport) -> None:
    rng = np.random.default_rng(spec.seed)
    count = max(1, int(spec.rate * spec.duration_s))
    offsets = np.cumsum(rng.exponential(1 / spec.rate, size=count))
    histogram = HdrHistogram(1, 120_000_000, 3)
    statuses: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    start = loop.time()

    # inferd bench's own lean client (aiohttp's cost ~0.8 ms of CPU a search, taken from the server's cores)
    pool = RawClient(f"{base}/search", loop.time, connections=100, rate=spec.rate, timeout_ms=spec.timeout_ms)
    await pool.start()
    bodies = [search_body(text[:4000], spec) for _, text in spec.queries]  # encoded once per query
    timeout_s = spec.timeout_ms / 1000 + 30

    async def one(i: int, at: float) -> None:
        if spec.fresh_queries:
            body = search_body(f"{spec.queries[i % len(spec.queries)][1][:4000]} zqx{i}", spec)
        else:
            body = bodies[i % len(bodies)]
        try:
            async with asyncio.timeout(timeout_s):
                status, _, raw = await pool.post(body, at + timeout_s)
        except (OSError, TimeoutError) as exc:  # HttpProtocolError is an OSError
            statuses[type(exc).__name__] += 1
            return
        statuses[str(status)] += 1
        histogram.record_value(max(1, int((loop.time() - at) * 1e6)))
        if status != 200:
            return
        answer = _answer.decode(raw)
        report.partial += answer.coverage.answered < answer.coverage.shards
        report.degraded += bool(answer.degraded)

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(faults(base, spec, report, http))
            for i, offset in enumerate(offsets):
                at = start + float(offset)
                await asyncio.sleep(max(0.0, at - loop.time()))
                tg.create_task(one(i, at))
    finally:
        await pool.close()
    elapsed = loop.time() - start
    report.sent = count
    report.statuses = dict(statuses)
    report.achieved_qps = round(histogram.get_total_count() / elapsed, 2) if elapsed > 0 else 0.0
    report.latency_ms = {
        f"p{p:g}": histogram.get_value_at_percentile(p) / 1000 for p in (50, 90, 99, 99.9)
    } | {"max": histogram.get_max_value() / 1000}


def search_body(text: str, spec: BenchSpec) -> bytes:
    """One search's JSON body under load."""
    body: dict[str, Any] = {"query": text, "k": spec.k, "mode": spec.mode, "timeout_ms": spec.timeout_ms}
    if not spec.result_cache:
        body["cache"] = False
    return _body.encode(body)


async def faults(base: str, spec: BenchSpec, report: BenchReport, http: aiohttp.ClientSession) -> None:
    """Kill, or stop for a while, one replica of shard 0 (a local server's worker process)."""
    t0 = time.monotonic()
    for at, how in sorted(
        [(spec.kill_at_s, "kill"), (spec.slow_at_s, "slow")], key=lambda x: x[0] if x[0] is not None else 0
    ):
        if at is None:
            continue
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        async with http.get(base) as r:
            workers = (await r.json())["workers"][0]
        if not workers:
            report.faults.append(f"{how}: shard 0 has no replica")
            continue
        pid = workers[0]["pid"]
        if how == "kill":
            os.kill(pid, signal.SIGKILL)
        elif spec.slow_factor is None:
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(spec.slow_s)
            os.kill(pid, signal.SIGCONT)
        else:
            await slow_down(pid, spec.slow_factor, spec.slow_s)
            how = f"slow x{spec.slow_factor:g} for {spec.slow_s:g}s"
        report.faults.append(f"{how} replica {workers[0]['worker']} (pid {pid}) at {at:.1f}s")


async def slow_down(pid: int, factor: float, seconds: float, period_s: float = 0.05) -> None:
    """Let the process run 1/factor of the time for `seconds`: SIGCONT, run, SIGSTOP, wait, every period."""
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(period_s / factor)
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(period_s * (1 - 1 / factor))
    finally:
        os.kill(pid, signal.SIGCONT)
