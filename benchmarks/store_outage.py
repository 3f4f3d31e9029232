"""Store outage: Redis down for --down seconds (30) under load, front ends sharing it.

N `inferd serve` front ends (--frontends, 3) on 127.0.0.1, 127.0.0.2, ... share one redis-server
(`--store redis://...`, no persistence: started again, it is empty), each with one local `sim` worker
and the same --config file. inferd's own open-loop generator (inferd.bench.loadgen.offer_load, every
answer checked) offers --rate req/s in all (200, Poisson), --rate/N to each front end, for --before (20)
+ --down (30) + --after (20) seconds, every request with an API key (no tenant is configured until the
end, so the key is not checked until then). Meanwhile, on a thread, on the clock of the load's start:
- at --before: Redis goes down. --how stop (default): redis-server is stopped (SIGTERM; it exits; the
  issue's "down"), and a new one is started on the same port at --before + --down. --how pause: it is
  SIGSTOPped and SIGCONTed (a hung store: connections open, nothing answered);
- while down: each front end's `inferd_cluster_store_up` and the holder's `inferd_cluster_lease_holder`,
  polled every 100 ms (when each showed 0); a scale (`POST /admin/models/sim/scale?workers=1`, a change
  that needs the lease) asked of every front end (all together) as Redis goes down, again once the
  holder no longer acts, and again halfway through (and of the holder once it shows the store down, if
  it still holds the lease then): status, error and how long it took to answer;
- once Redis is back: when each front end shows the store up again, when one holds the lease, when a
  scale asked of each is carried out again; then a change: the config file gains a tenant with the
  load's key and `POST /admin/reload` is asked of front end 0, and each front end is asked every 50 ms
  for a request without a key until it answers 401 (it has read the file for the new generation): the
  time from the reload to each front end's first 401, and the reload's own answer.

Reported: per phase (before / down / after, by each request's intended send time) requests sent, ok,
errors by kind, ok/s, goodput (ok within --slo-ms, per s), p50 / p99 / max latency; the worst second
per front end; the timeline above.

    .venv/bin/python benchmarks/store_outage.py [--frontends 3] [--rate 200] [--before 20] [--down 30]
        [--after 20] [--how stop|pause] [--slo-ms 100]

Writes .bench/store_outage.json and prints markdown tables. Exits 1 when an answer was wrong (another's,
or a wrong digest), 2 when a server could not be started.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import OUT_DIR, ServerNotReady, cell, interrupt_on, write_json
from store_cluster import FrontEnd, Ports, RedisProcess, cluster_config, wait_until

from inferd.bench.load_spec import LoadSpec
from inferd.bench.loadgen import offer_load
from inferd.bench.open_loop import arrival_offsets, run_blocking
from inferd.bench.report import PhaseReport, Recorder
from inferd.gateway.keys import key_digest, new_key

SCALE = "/admin/models/sim/scale?workers=1"
"""A change that needs the store and the lease and starts nothing (each front end runs one local worker)."""

PHASES = ("before", "down", "after")


class Timeline:
    """What the orchestrating thread saw, in seconds from the load's start."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, event: str, **detail: Any) -> None:
        with self.lock:
            self.events.append({"t": round(self.now(), 3), "event": event, **detail})
        print(f"  {self.now():6.2f} s  {event} {detail if detail else ''}", file=sys.stderr)

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))


def poll_each(
    tl: Timeline, frontends: list[FrontEnd], event: str, check: Callable[[FrontEnd], bool], timeout_s: float,
    poll_s: float = 0.1,
) -> dict[str, float | None]:
    """When (s from the load's start) each front end first passed `check`; None if not within timeout_s."""
    seen: dict[str, float | None] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < len(frontends) and time.monotonic() < deadline:
        for fe in frontends:
            if fe.id not in seen and check(fe):
                seen[fe.id] = round(tl.now(), 3)
                tl.add(event, frontend=fe.id)
        time.sleep(poll_s)
    return {fe.id: seen.get(fe.id) for fe in frontends}


def scale_each(tl: Timeline, frontends: list[FrontEnd], event: str) -> list[dict[str, Any]]:
    """A scale asked of every front end at once (a thread each): what each answered, and how fast."""
    out: list[dict[str, Any]] = []

    def ask(fe: FrontEnd) -> None:
        asked = tl.now()
        status, answer, took = fe.post_admin(SCALE, timeout_s=30.0)
        out.append({"frontend": fe.id, "asked_at": round(asked, 3), "status": status, "answer_s": round(took, 3),
                    "answer": answer})  # fmt: skip
        tl.add(event, frontend=fe.id, status=status, answer_s=round(took, 3), answer=str(answer)[:60])

    threads = [threading.Thread(target=ask, args=(fe,), daemon=True) for fe in frontends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(35.0)
    return out


class Outage:
    """Takes Redis down and brings it back (--how), and records what the front ends do meanwhile."""

    def __init__(
        self, args: argparse.Namespace, redis: RedisProcess, frontends: list[FrontEnd], config: Path, key: str,
        log_dir: Path,
    ) -> None:  # fmt: skip
        self.args, self.redis, self.frontends, self.config, self.key = args, redis, frontends, config, key
        self.log_dir = log_dir
        self.result: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.paused = False
        self.tl: Timeline | None = None

    def start(self, t0: float) -> None:
        self.tl = Timeline(t0)
        self.thread = threading.Thread(target=self._run, name="outage", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._scenario()
        except BaseException as exc:  # reported by main; Redis is brought back by `restore`
            self.error = exc
            self.restore()

    def _scenario(self) -> None:
        a, tl, fes = self.args, self.tl, self.frontends
        assert tl is not None
        r = self.result
        holders = [fe for fe in fes if fe.holds()]
        r["holder_before"] = [fe.id for fe in holders]
        tl.sleep_until(a.before)
        self.down()
        tl.add("redis down", how=a.how)
        r["down_at"] = round(tl.now(), 3)
        at_once = threading.Thread(
            target=lambda: r.__setitem__("scale_at_once", scale_each(tl, fes, "scale at once")), daemon=True
        )
        at_once.start()  # while the gauges are polled
        r["store_down_seen"] = poll_each(tl, fes, "store_up 0", lambda fe: fe.store_up() == 0.0, a.down / 2)
        at_once.join(35.0)
        if any(fe.holds() for fe in holders):  # it shows the store down and still holds the lease
            r["scale_holder_store_down"] = scale_each(tl, holders, "scale asked of the holder showing store_up 0")
        r["holder_gone"] = poll_each(tl, holders, "lease_holder 0", lambda fe: not fe.holds(), a.down / 2)
        r["scale_down_1"] = scale_each(tl, fes, "scale once no holder")
        tl.sleep_until(a.before + a.down / 2)
        r["scale_down_2"] = scale_each(tl, fes, "scale while down (halfway)")
        tl.sleep_until(a.before + a.down)
        self.up()
        r["up_at"] = round(tl.now(), 3)
        tl.add("redis up")
        r["store_up_seen"] = poll_each(tl, fes, "store_up 1", lambda fe: fe.store_up() == 1.0, a.after / 2)
        holder = poll_each(tl, [fes[0]], "a holder again", lambda _: any(fe.holds() for fe in fes), a.after / 2)
        r["holder_again"] = holder[fes[0].id]
        r["scale_ok_again"] = poll_each(
            tl, fes, "scale carried out again", lambda fe: fe.post_admin(SCALE, 10.0)[0] == 200, a.after / 2
        )
        self.change()

    def change(self) -> None:
        """A change after the store is back: a new tenant with the load's key, reloaded on front end 0;
        when each front end refuses a request without a key."""
        tl, fes = self.tl, self.frontends
        assert tl is not None
        self.config.write_text(
            cluster_config(extra=f'[tenants.bench]\napi_key_sha256 = ["{key_digest(self.key)}"]\n')
        )
        answer: dict[str, Any] = {}

        def reload() -> None:
            status, body, took = fes[0].post_admin("/admin/reload", timeout_s=30.0)
            answer.update(status=status, answer_s=round(took, 3), frontends=body.get("frontends"),
                          diverged=body.get("diverged"), error=body.get("error"))  # fmt: skip

        asked = tl.now()
        tl.add("reload asked", frontend=fes[0].id)
        thread = threading.Thread(target=reload, name="reload", daemon=True)
        thread.start()
        seen = poll_each(tl, fes, "refuses a keyless request", lambda fe: fe.infer_status() == 401, 15.0, 0.05)
        thread.join(35.0)
        self.result["reload"] = answer
        self.result["reload_asked_at"] = round(asked, 3)
        self.result["keyless_401_after_s"] = {k: None if v is None else round(v - asked, 3) for k, v in seen.items()}
        tl.add("reload answered", **{k: v for k, v in answer.items() if k != "frontends"})

    def down(self) -> None:
        if self.args.how == "pause":
            os.kill(self.redis.pid, signal.SIGSTOP)
            self.paused = True
        else:
            self.redis.stop()

    def up(self) -> None:
        if self.args.how == "pause":
            os.kill(self.redis.pid, signal.SIGCONT)
            self.paused = False
        else:
            self.redis = RedisProcess(self.redis.port, log_path=self.log_dir / "redis-again.log")
            self.redis.start()
            self.redis.ready_s = self.redis.wait_ready()

    def restore(self) -> None:
        """Whatever happened: a paused Redis is resumed (so that it can be stopped)."""
        if self.paused:
            os.kill(self.redis.pid, signal.SIGCONT)
            self.paused = False


def load(args: argparse.Namespace, frontends: list[FrontEnd], key: str, outage: Outage) -> dict[str, Any]:
    """Offer the load to every front end at once; per phase recorders and each front end's per-second counts."""
    total = args.before + args.down + args.after
    bounds = (args.before, args.before + args.down)
    recorders = {p: Recorder(slo_ms=args.slo_ms) for p in PHASES}

    def phase(offset: float) -> str:
        return "before" if offset < bounds[0] else "down" if offset < bounds[1] else "after"

    def recorder_for(i: int, offset: float) -> Recorder:
        return recorders[phase(offset)]

    specs = [
        LoadSpec(
            url=fe.url, model="sim", rate=args.rate / len(frontends), duration_s=total, seed=i + 1,
            slo_ms=args.slo_ms, timeout_ms=args.timeout_ms, headers=(("Authorization", f"Bearer {key}"),),
            connections=256,
        )
        for i, fe in enumerate(frontends)
    ]  # fmt: skip
    offsets = [arrival_offsets(s) for s in specs]

    async def main() -> list[Any]:
        return await asyncio.gather(*(
            offer_load(s, o, recorder_for, on_start=outage.start if i == 0 else None)
            for i, (s, o) in enumerate(zip(specs, offsets, strict=True))
        ))  # fmt: skip

    offered = run_blocking(main())
    windows = {"before": args.before, "down": args.down, "after": args.after}
    phases = {p: PhaseReport.from_recorder(recorders[p], windows[p]).to_dict() for p in PHASES}
    seconds = []
    for fe, o, done in zip(frontends, offsets, offered, strict=True):
        per_s: dict[int, list[int]] = {}
        for offset, result in zip(o, done.results, strict=True):
            bucket = per_s.setdefault(int(offset), [0, 0, 0])  # ok, not ok, never sent
            bucket[0 if result >= 0 else 2 if math.isnan(result) else 1] += 1
        seconds.append({"frontend": fe.id, "per_second": [per_s.get(s, [0, 0, 0]) for s in range(int(total))]})
    return {"phases": phases, "seconds": seconds, "sent": sum(d.sent for d in offered)}


def print_tables(run: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"| phase | s | sent | ok | errors | ok/s | goodput/s (<= {args.slo_ms:g} ms) | p50 ms | p99 ms | max ms |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for name, p in run["load"]["phases"].items():
        errors = ", ".join(f"{k}: {v}" for k, v in p["errors"].items() if v) or "0"
        lat = p["latency_ms"]
        print(
            f"| {name} | {p['window_s']:g} | {p['sent']:,} | {p['ok']:,} | {errors} | {p['achieved_rps']:.1f} | "
            f"{cell(p['goodput_rps'])} | {cell(lat.get('p50'))} | {cell(lat.get('p99'))} | "
            f"{cell(lat.get('max', lat.get('p99.9')))} |"
        )
    print("\n| front end | fewest ok in one second while down (of sent) | not ok while down |")
    print("|---|---|---:|")
    b, d = args.before, args.before + args.down
    for row in run["load"]["seconds"]:
        down = row["per_second"][int(b) : int(d)]
        worst = min(down, key=lambda c: c[0] / max(1, c[0] + c[1])) if down else [0, 0, 0]
        print(f"| {row['frontend']} | {worst[0]} of {worst[0] + worst[1]} | {sum(c[1] for c in down)} |")
    o = run["outage"]
    print("\n```")
    for e in o.get("events", []):
        print(f"{e['t']:7.2f} s  {e['event']}  " + ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "event")))
    print("```")
    said = {
        str(s["answer"].get("error", s["answer"]))
        for key in ("scale_at_once", "scale_holder_store_down", "scale_down_1", "scale_down_2")
        for s in o.get(key, [])
        if s["status"] != 200
    }
    for text in sorted(said):
        print(f"\nrefused while down: {text}")
    print(f"\nreload after: {o.get('reload')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frontends", type=int, default=3)
    ap.add_argument("--rate", type=float, default=200.0, help="req/s in all, split evenly over the front ends")
    ap.add_argument("--before", type=float, default=20.0)
    ap.add_argument("--down", type=float, default=30.0)
    ap.add_argument("--after", type=float, default=20.0)
    ap.add_argument("--how", choices=("stop", "pause"), default="stop")
    ap.add_argument("--slo-ms", type=float, default=100.0)
    ap.add_argument("--timeout-ms", type=float, default=5000.0)
    args = ap.parse_args()
    if not 2 <= args.frontends <= 8 or not 0 < args.rate <= 2000 or args.before + args.down + args.after > 300:
        raise SystemExit("--frontends within 2..8, --rate within (0, 2000], at most 300 s in all")
    if args.after < 10:
        raise SystemExit("--after must leave time for the front ends to converge (>= 10 s)")
    interrupt_on(signal.SIGTERM, signal.SIGHUP)
    log_dir = OUT_DIR / "store_outage"
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = Ports()
    config = log_dir / "inferd.toml"
    config.write_text(cluster_config())
    key = new_key()
    outage: Outage | None = None
    frontends: list[FrontEnd] = []
    redis = RedisProcess(ports.take(), log_path=log_dir / "redis.log")
    try:
        redis.start()
        redis.ready_s = redis.wait_ready()
        frontends = [FrontEnd(i, redis.url, config, ports, log_dir) for i in range(args.frontends)]
        for fe in frontends:
            fe.start()
        for fe in frontends:
            fe.ready_s = fe.wait_ready()
        wait_until("one lease holder", lambda: sum(fe.holds() for fe in frontends) == 1, 30.0, 0.2)
        wait_until("the store up everywhere", lambda: all(fe.store_up() == 1.0 for fe in frontends), 30.0, 0.2)
        outage = Outage(args, redis, frontends, config, key, log_dir)
        started = time.strftime("%H:%M:%S")
        load_result = load(args, frontends, key, outage)
        if outage.thread is not None:
            outage.thread.join(60.0)
        if outage.error is not None:
            raise outage.error
        run = {
            "started": started, "args": vars(args), "load": load_result,
            "outage": outage.result | {"events": outage.tl.events if outage.tl else []},
        }  # fmt: skip
    except (ServerNotReady, TimeoutError) as exc:
        print(f"store_outage: {exc}", file=sys.stderr)
        return 2
    finally:
        if outage is not None:
            outage.restore()
            outage.redis.stop()
        redis.stop()
        for fe in frontends:
            fe.stop()
    write_json(OUT_DIR / "store_outage.json", run)
    print_tables(run, args)
    wrong = sum(p["mismatched"] for p in run["load"]["phases"].values())
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
