"""A pool under Zipf load: 12 `sim` models served by one pool of 2 workers with room for 3 models each.

The workload, fixed before the run from --seed: Poisson arrivals at --rate for --seconds (at most
--max-requests), each request for model k (m01 the hottest .. m12) with probability proportional to
k^-s (Zipf, --zipf-s 1.1). Every model has the same `sim` cost (--base-ms + --per-item-ms per item,
batches of --max-batch, --max-wait-ms) and, in the pool, `params.memory_mb` (--memory-mb, also its
`memory_mb` estimate) and `params.load_ms` (--load-ms: a load sleeps that long).

The pool: `[pools.p] workers = 2`, `memory_budget_mb = --budget-mb` (3.5 x memory_mb: room for 3 with
headroom for what the worker measures above the allocation), `max_loaded_models = 3`, `min_resident_s =
--min-resident-s`. One front end; the load starts once both pool workers have joined, and is inferd's
open-loop sender (the requests go out at their intended times whatever the server does; latency from
the intended time; every answer checked: its own id and `sim_digest(model, version, payload)`).

What is reported:
- **Warm-hit p99** of m01 (and of every model together) against the **dedicated baseline**: m01 alone
  on a server of its own with one ordinary worker (`workers = 1`, same sim cost and batching), sent the
  very same m01 requests at the same offsets. A pool request is a *warm hit* unless it waited for a
  load: an answer whose latency is at least 0.9 x load_ms waited for a load (the load alone takes
  load_ms), and so did every request of the same model sent between that one's send and its answer (it
  joined the same load). Everything else is a warm hit. (A warm request slower than 0.9 x load_ms would
  be counted cold: the report gives the count of load waits beside the server's load count, so that a
  mismatch shows.)
- **Loads**: `inferd_model_loads_total` summed over the models from /metrics at the end, against an
  offline LRU replay of the same request sequence. Two caches of 3 are modelled as one LRU of 6 slots:
  a miss fills a free slot on either worker, else evicts the least recently used model of the two
  workers (the older of their two LRU entries) — which is exactly one LRU cache of 6. Also shown: the
  offline optimum (Belady: evict the model needed furthest in the future), a floor no cache reaches.
- **Errors**: every answer other than 200, by kind. Allowed: 429 with a Retry-After header; anything else
  (a 429 without Retry-After, 503, a timeout, a wrong answer) counts as an error and fails the run.

    .venv/bin/python benchmarks/pool_zipf.py [--rate 10] [--seconds 60] [--max-requests 2000]
        [--load-ms 200] [--memory-mb 64] [--min-resident-s 0.5] [--seed 1] [--no-baseline] [--no-pool]
        [--side-by-side]  (the pool and the dedicated worker run at the same time, under the same noise)

Writes .bench/pool_zipf.json (with every request of each server: its model, offset, intended send time on
the wall clock, outcome, latency, and the server's X-Inferd-Queue-Ms and X-Inferd-Compute-Ms) and prints markdown tables. Exits 1 when the run had an error other than
429 with Retry-After or a wrong answer, 2 when a server could not be started.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
import time
import urllib.request
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from harness import OUT_DIR, InferdServer, ServerNotReady, cell, interrupt_on, write_json
from prometheus_client.parser import text_string_to_metric_families

from inferd.bench.infer_requests import AnswerChecker, payload_for, request_id
from inferd.bench.infer_transport import make_transport
from inferd.bench.load_spec import LoadSpec
from inferd.bench.open_loop import exponential_gaps, renewal_times, run_blocking, sleep_until

POOL = "p"


# --- the workload -----------------------------------------------------------------------------------


def zipf_probabilities(n: int, s: float) -> np.ndarray:
    """P(rank k) proportional to k^-s, k = 1..n."""
    weights = np.arange(1, n + 1, dtype=float) ** -s
    return weights / weights.sum()


@dataclass(frozen=True)
class Workload:
    """The requests of a run, fixed before it: request i goes to names[models[i]] at offsets[i] s."""

    names: tuple[str, ...]
    offsets: tuple[float, ...]
    models: tuple[int, ...]

    def only(self, model: int, name: str) -> Workload:
        """The requests for one model, at the same offsets, sent to `name`."""
        keep = [i for i, m in enumerate(self.models) if m == model]
        return Workload((name,), tuple(self.offsets[i] for i in keep), tuple(0 for _ in keep))


def zipf_workload(n: int, s: float, rate: float, seconds: float, max_requests: int, seed: int) -> Workload:
    """Poisson arrivals at `rate` over `seconds` (at most max_requests), each for a Zipf(s) model."""
    rng = np.random.default_rng(seed)
    offsets = renewal_times(exponential_gaps(rng, rate), rate, seconds, max_requests)
    models = rng.choice(n, size=len(offsets), p=zipf_probabilities(n, s))
    names = tuple(f"m{k + 1:02d}" for k in range(n))
    return Workload(names, tuple(offsets.tolist()), tuple(int(m) for m in models))


# --- the offline caches ----------------------------------------------------------------------------


def lru_loads(sequence: Sequence[int], slots: int) -> int:
    """Loads (misses, from empty) of an LRU cache of `slots` models replaying `sequence`."""
    cache: OrderedDict[int, None] = OrderedDict()
    loads = 0
    for model in sequence:
        if model in cache:
            cache.move_to_end(model)
            continue
        loads += 1
        cache[model] = None
        if len(cache) > slots:
            cache.popitem(last=False)
    return loads


def belady_loads(sequence: Sequence[int], slots: int) -> int:
    """Loads of the offline optimum (evict the model next needed furthest ahead) replaying `sequence`."""
    next_use = [math.inf] * len(sequence)
    seen: dict[int, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        next_use[i] = seen.get(sequence[i], math.inf)
        seen[sequence[i]] = i
    held: dict[int, float] = {}  # model -> its next use
    loads = 0
    for i, model in enumerate(sequence):
        if model not in held:
            loads += 1
            if len(held) >= slots:
                del held[max(held, key=held.__getitem__)]
        held[model] = next_use[i]
    return loads


# --- sending -----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request: its model, its intended offset, and what came back."""

    model: int
    offset: float
    kind: str = "unsent"
    """'ok', an error kind (`http_429`, `timeout`, `connection`...) or a mismatch (`wrong_digest`...)."""
    latency_s: float | None = None
    """From the intended send time to the answer, for every answer (any status)."""
    retry_after: str | None = None
    queue_ms: float | None = None
    """The server's X-Inferd-Queue-Ms (waiting in the model's queue, a load included) and
    X-Inferd-Compute-Ms (its batch on the device), on ok answers."""
    compute_ms: float | None = None
    at_unix: float | None = None
    """The intended send time on the wall clock (to line a request up with the servers' logs)."""


async def offer(url: str, work: Workload, timeout_ms: float, seed: int) -> list[Outcome]:
    """Send every request of `work` at its intended time (open loop); each answer checked."""
    now = time.monotonic
    specs = [LoadSpec(url=url, model=name, timeout_ms=timeout_ms, seed=seed, connections=256) for name in work.names]
    transports = [make_transport(spec, now) for spec in specs]
    checkers = [AnswerChecker(t.fields) for t in transports]
    outcomes = [Outcome(m, o) for m, o in zip(work.models, work.offsets, strict=True)]
    for t in transports:
        await t.start()

    async def one(i: int, intended: float) -> None:
        out = outcomes[i]
        rid, payload = request_id(seed, i), payload_for(seed, i, 32)
        deadline = intended + timeout_ms / 1000.0
        checker = checkers[out.model]
        checker.outstanding.add(rid)
        try:
            async with asyncio.timeout_at(deadline + skew):
                failed, headers, raw = await transports[out.model].send(rid, payload, deadline)
        except TimeoutError:
            out.kind = "timeout"
        except OSError:
            out.kind = "connection"
        except asyncio.CancelledError:
            out.kind = "timeout"
            raise
        else:
            out.latency_s = now() - intended
            out.retry_after = headers.get("Retry-After")
            out.queue_ms, out.compute_ms = header_ms(headers, "X-Inferd-Queue-Ms"), header_ms(headers, "X-Inferd-Compute-Ms")
            out.kind = failed if failed is not None else checker.check(rid, payload, raw)
        finally:
            checker.outstanding.discard(rid)

    skew = asyncio.get_running_loop().time() - now()
    t0 = now() + 0.05
    wall = time.time() - now()
    for out in outcomes:
        out.at_unix = round(t0 + out.offset + wall, 4)
    hard_stop = t0 + (work.offsets[-1] if work.offsets else 0.0) + timeout_ms / 1000.0 + 1.0
    try:
        async with asyncio.timeout_at(hard_stop + skew), asyncio.TaskGroup() as tg:
            for i, offset in enumerate(work.offsets):
                await sleep_until(t0 + offset, now)
                tg.create_task(one(i, t0 + offset))
    except TimeoutError:
        pass  # what was still outstanding was cancelled and counted as timeouts
    finally:
        for t in transports:
            await t.close()
    return outcomes


def header_ms(headers: Mapping[str, str], name: str) -> float | None:
    try:
        return float(headers[name])
    except (KeyError, ValueError):
        return None


# --- what the answers say ---------------------------------------------------------------------------


def load_waits(outcomes: Sequence[Outcome], cold_s: float) -> tuple[list[bool], int]:
    """Per request, whether it waited for a load (see the module docstring); and how many loads those
    waits show (requests at least `cold_s` late that did not join an earlier one's load)."""
    waited = [False] * len(outcomes)
    loads_seen = 0
    open_until: dict[int, float] = {}  # model -> answer offset of the last request known to wait for a load
    for i, out in enumerate(outcomes):  # in send order
        if out.latency_s is None:
            continue
        if out.offset <= open_until.get(out.model, -1.0):
            waited[i] = True
        elif out.kind == "ok" and out.latency_s >= cold_s:
            waited[i] = True
            loads_seen += 1
        if waited[i]:
            open_until[out.model] = max(open_until.get(out.model, -1.0), out.offset + out.latency_s)
    return waited, loads_seen


def percentiles_ms(latencies: Sequence[float]) -> dict[str, float | None]:
    if not latencies:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ms = np.asarray(latencies) * 1000.0
    return {"n": len(ms), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "max": float(ms.max())}  # fmt: skip


def error_kinds(outcomes: Sequence[Outcome]) -> tuple[dict[str, int], dict[str, int]]:
    """(allowed: 429s with Retry-After; errors: every other answer that is not ok), by kind."""
    allowed: dict[str, int] = defaultdict(int)
    errors: dict[str, int] = defaultdict(int)
    for out in outcomes:
        if out.kind == "ok":
            continue
        if out.kind == "http_429" and out.retry_after:
            allowed["429 with Retry-After"] += 1
        else:
            errors[out.kind if out.kind != "http_429" else "429 without Retry-After"] += 1
    return dict(allowed), dict(errors)


@dataclass
class Summary:
    requests: int
    ok: int
    allowed: dict[str, int]
    errors: dict[str, int]
    latency_ms: dict[str, float | None]
    """Of every ok answer."""
    warm_ms: dict[str, float | None]
    """Of the ok answers that did not wait for a load (all of them when no load is known)."""
    by_model: dict[str, dict[str, Any]] = field(default_factory=dict)


def summarize(work: Workload, outcomes: Sequence[Outcome], cold_s: float | None) -> Summary:
    """Latencies of ok answers, over all and per model: warm hits apart when `cold_s` is given."""
    waited, _ = load_waits(outcomes, cold_s) if cold_s is not None else ([False] * len(outcomes), 0)
    allowed, errors = error_kinds(outcomes)
    ok = [o for o in outcomes if o.kind == "ok"]
    warm = [o.latency_s or 0.0 for o, w in zip(outcomes, waited, strict=True) if o.kind == "ok" and not w]
    summary = Summary(len(outcomes), len(ok), allowed, errors, percentiles_ms([o.latency_s or 0.0 for o in ok]),
                      percentiles_ms(warm))  # fmt: skip
    for k, name in enumerate(work.names):
        mine = [(o, w) for o, w in zip(outcomes, waited, strict=True) if o.model == k]
        summary.by_model[name] = {
            "requests": len(mine),
            "ok": percentiles_ms([o.latency_s or 0.0 for o, _ in mine if o.kind == "ok"]),
            "warm": percentiles_ms([o.latency_s or 0.0 for o, w in mine if o.kind == "ok" and not w]),
            "waited_for_load": sum(w for _, w in mine),
        }
    return summary


# --- the servers ------------------------------------------------------------------------------------


def sim_toml(args: argparse.Namespace, pooled: bool) -> str:
    head = f'pool = "{POOL}"\nmemory_mb = {args.memory_mb:g}\n' if pooled else "workers = 1\n"
    params = f"memory_mb = {args.memory_mb:g}\nload_ms = {args.load_ms:g}\n" if pooled else ""
    return f"""builtin = "sim"
{head}max_batch_size = {args.max_batch}
max_wait_ms = {args.max_wait_ms:g}
default_timeout_ms = {int(args.timeout_ms)}

[params]
base_ms = {args.base_ms:g}
per_item_ms = {args.per_item_ms:g}
{params}"""


def pool_config(args: argparse.Namespace) -> str:
    return f"""[pools.{POOL}]
workers = 2
memory_budget_mb = {args.budget_mb:g}
max_loaded_models = 3
min_resident_s = {args.min_resident_s:g}
"""


def scrape(url: str) -> dict[str, dict[str, float]]:
    """Sample name -> {the model or pool/worker labels, joined: value} of one /metrics scrape."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[sample.name][key] = out[sample.name].get(key, 0.0) + sample.value
    return out


def wait_for_pool_workers(url: str, n: int, within_s: float = 60.0) -> None:
    """Until `n` pool workers have joined (their budget gauges on /metrics): the load starts on the whole pool."""
    deadline = time.monotonic() + within_s
    while len(scrape(url).get("inferd_pool_memory_budget_mb", {})) < n:
        if time.monotonic() > deadline:
            raise ServerNotReady(f"fewer than {n} pool workers joined within {within_s:g} s")
        time.sleep(0.1)


def pool_server(args: argparse.Namespace, work: Workload) -> InferdServer:
    models = {name: sim_toml(args, pooled=True) for name in work.names}
    return InferdServer("--log-level", args.log_level, name="pool_zipf", config=pool_config(args), models=models,
                        log_path=OUT_DIR / "pool_zipf" / "pool.log", ready_timeout_s=60.0, grace_s=15.0)  # fmt: skip


def dedicated_server(args: argparse.Namespace, name: str) -> InferdServer:
    return InferdServer("--log-level", "WARNING", name="pool_zipf_dedicated", models={name: sim_toml(args, False)},
                        log_path=OUT_DIR / "pool_zipf" / "dedicated.log", ready_timeout_s=60.0, grace_s=15.0)  # fmt: skip


def pool_result(args: argparse.Namespace, work: Workload, outcomes: list[Outcome], metrics: dict) -> dict[str, Any]:
    loads = metrics.get("inferd_model_loads_total", {})
    evictions = metrics.get("inferd_model_evictions_total", {})
    _, loads_seen = load_waits(outcomes, 0.9 * args.load_ms / 1000.0)
    summary = summarize(work, outcomes, 0.9 * args.load_ms / 1000.0)
    return {"summary": asdict(summary), "loads_by_model": loads, "loads": sum(loads.values()),
            "evictions": sum(evictions.values()), "loads_seen_by_clients": loads_seen,
            "pool_memory_used_mb": metrics.get("inferd_pool_memory_used_mb", {}),
            "pool_models_loaded": metrics.get("inferd_pool_models_loaded", {}),
            "load_seconds": {k: v for k, v in metrics.items() if k.startswith("inferd_model_load_seconds_")},
            "requests": [asdict(o) for o in outcomes]}  # fmt: skip


def pool_run(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    with pool_server(args, work) as server:
        wait_for_pool_workers(server.url, 2)
        outcomes = run_blocking(offer(server.url, work, args.timeout_ms, args.seed))
        metrics = scrape(server.url)
    return pool_result(args, work, outcomes, metrics)


def dedicated_run(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    """m01's requests alone, at the same offsets, to the same model on a worker of its own."""
    mine = work.only(0, work.names[0])
    with dedicated_server(args, work.names[0]) as server:
        outcomes = run_blocking(offer(server.url, mine, args.timeout_ms, args.seed))
    return dedicated_result(mine, outcomes)


def dedicated_result(mine: Workload, outcomes: list[Outcome]) -> dict[str, Any]:
    return {"summary": asdict(summarize(mine, outcomes, None)), "requests": [asdict(o) for o in outcomes]}


def side_by_side_run(args: argparse.Namespace, work: Workload) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pool's run and the dedicated worker's at the same time (two servers, one sender), so that
    whatever else the machine does falls on both alike; each also takes the other's CPU."""
    mine = work.only(0, work.names[0])
    with pool_server(args, work) as pool, dedicated_server(args, work.names[0]) as dedicated:
        wait_for_pool_workers(pool.url, 2)

        async def both() -> list[list[Outcome]]:
            return list(await asyncio.gather(offer(pool.url, work, args.timeout_ms, args.seed),
                                             offer(dedicated.url, mine, args.timeout_ms, args.seed)))  # fmt: skip

        pool_outcomes, dedicated_outcomes = run_blocking(both())
        metrics = scrape(pool.url)
    return pool_result(args, work, pool_outcomes, metrics), dedicated_result(mine, dedicated_outcomes)


# --- the report -------------------------------------------------------------------------------------


def print_report(run: dict[str, Any]) -> None:
    a, w = run["args"], run["workload"]
    print(f"{w['requests']} requests over {a['seconds']:g} s at {a['rate']:g}/s, Zipf s = {a['zipf_s']:g} over "
          f"{len(w['share'])} models (m01 {w['share'][0]:.1%} .. m12 {w['share'][-1]:.1%}), seed {a['seed']}; "
          f"sim {a['base_ms']:g} ms + {a['per_item_ms']:g} ms/item, load {a['load_ms']:g} ms, "
          f"{a['memory_mb']:g} MB each; pool budget {a['budget_mb']:g} MB x 2 workers, 3 models each\n")  # fmt: skip
    pool, ded = run.get("pool"), run.get("dedicated")
    print("| | requests | ok | warm hits | warm p50 ms | warm p99 ms | all ok p99 ms | errors | 429 + Retry-After |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    if pool is not None:
        s = pool["summary"]
        m01 = s["by_model"]["m01"]
        row(f"pool, m01 ({m01['requests']} requests)", m01["requests"], m01["ok"]["n"], m01["warm"], m01["ok"], None)
        row(f"pool, all {len(s['by_model'])} models", s["requests"], s["ok"], s["warm_ms"], s["latency_ms"], s)
    if ded is not None:
        s = ded["summary"]
        row("dedicated worker, m01", s["requests"], s["ok"], s["warm_ms"], s["latency_ms"], s)
    if pool is not None:
        lru, opt = run["offline"]["lru_6"], run["offline"]["belady_6"]
        print(f"\nloads: {pool['loads']:.0f} (inferd_model_loads_total), offline LRU of 6 slots {lru}, offline "
              f"optimum {opt}; ratio to LRU {pool['loads'] / lru:.2f}; evictions {pool['evictions']:.0f}; "
              f"loads the clients waited for: {pool['loads_seen_by_clients']}")  # fmt: skip


def row(label: str, requests: int, ok: int, warm: dict, every: dict, s: dict | None) -> None:
    err = "-" if s is None else (", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "0")
    allowed = "-" if s is None else str(sum(s["allowed"].values()))
    print(f"| {label} | {requests} | {ok} | {warm['n']} | {cell(warm['p50'])} | {cell(warm['p99'])} | "
          f"{cell(every['p99'])} | {err} | {allowed} |")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=12)
    ap.add_argument("--zipf-s", type=float, default=1.1)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second, all models together")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--base-ms", type=float, default=5.0)
    ap.add_argument("--per-item-ms", type=float, default=1.0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-wait-ms", type=float, default=2.0)
    ap.add_argument("--load-ms", type=float, default=200.0)
    ap.add_argument("--memory-mb", type=float, default=64.0)
    ap.add_argument("--budget-mb", type=float, default=None, help="per pool worker (default 3.5 x --memory-mb)")
    ap.add_argument("--min-resident-s", type=float, default=0.5)
    ap.add_argument("--timeout-ms", type=float, default=10000.0)
    ap.add_argument("--log-level", default="WARNING", help="the pool server's (its log: .bench/pool_zipf/pool.log)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the dedicated worker's run")
    ap.add_argument("--no-pool", action="store_true", help="skip the pool's run (the baseline only)")
    ap.add_argument("--side-by-side", action="store_true", help="run the pool and the dedicated worker at the same time")
    args = ap.parse_args()
    args.budget_mb = args.budget_mb or 3.5 * args.memory_mb
    if not 2 <= args.models <= 50 or args.rate <= 0 or not 0 < args.seconds <= 300 or args.load_ms <= 0:
        raise SystemExit("--models within 2..50, --rate > 0, --seconds within (0, 300], --load-ms > 0")
    interrupt_on(signal.SIGTERM, signal.SIGHUP)
    work = zipf_workload(args.models, args.zipf_s, args.rate, args.seconds, args.max_requests, args.seed)
    share = np.bincount(np.asarray(work.models, dtype=int), minlength=args.models) / max(1, len(work.models))
    run: dict[str, Any] = {
        "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "args": vars(args), "workload": {"requests": len(work.offsets), "share": share.tolist()},
        "offline": {"lru_6": lru_loads(work.models, 6), "lru_3": lru_loads(work.models, 3),
                    "belady_6": belady_loads(work.models, 6)},
    }  # fmt: skip
    try:
        if args.side_by_side:
            run["pool"], run["dedicated"] = side_by_side_run(args, work)
        elif not args.no_baseline:
            run["dedicated"] = dedicated_run(args, work)
        if not args.no_pool and not args.side_by_side:
            run["pool"] = pool_run(args, work)
    except ServerNotReady as exc:
        print(f"pool_zipf: {exc}", file=sys.stderr)
        write_json(OUT_DIR / "pool_zipf.json", run)
        return 2
    write_json(OUT_DIR / "pool_zipf.json", run)
    print_report(run)
    failed = any(run[k]["summary"]["errors"] for k in ("pool", "dedicated") if k in run)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
