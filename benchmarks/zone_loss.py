"""Zone loss: --zones (3) zones under load at --load (60%) of the fleet's capacity, the last zone cut off
by nftables for --down seconds and healed.

The fleet is zone_cluster.py's: each zone a front-end host and a worker host of --workers `sim` workers
(each joining every front end), in network namespaces, and a Redis host. Each zone's clients offer an equal
part of the load to their zone's front end (inferd's open-loop generator, inferd.bench.loadgen: Poisson
arrivals, every answer checked: its own id and digest), for --before + --down + --after seconds. The
fleet's capacity is its devices' full-batch capacity (zone_cluster.py), checked first by --capacity-s of
load at 1.5x it (the answers per second until the last came back); where that measures less (a machine
short of CPU), the measured figure is the capacity.

At --before, the last zone's hosts (its front end and its workers) lose every packet to and from
everything else: the other zones, the Redis host and every client. Its clients, as a global load balancer
would send them, go on to their own front end for --failover-s (its health checks failing), then to the
surviving front ends in turn; at --before + --down the zone heals, and --failover-s later its clients
are back on its front end. Requests the cut-off front end held are lost (the clients' --timeout-ms).

Reported, per phase (before / during / after, by each request's intended send time): goodput (answers
within --slo-ms per second, the whole fleet), the p50 / p99 of the surviving front ends' clients (those
redirected to them included), failures by cause, separately for the surviving front ends and the lost
one; per front end, the share of its work served in its own zone (inferd_requests_by_zone_total) and
what spilled; the timeline (the cut, each surviving front end giving the zone's workers up, the heal, the
workers back, the front end answering again).

    sudo .venv/bin/python benchmarks/zone_loss.py [--zones 3] [--workers 1] [--load 0.6] [--before 20]
        [--down 30] [--after 30] [--failover-s 5] [--slo-ms 500] [--timeout-ms 3000] [--capacity-s 8]

Writes .bench/zone_loss.json and prints markdown tables. Exits 1 when an answer was wrong (another's, or
a wrong digest), 2 when the fleet could not be started. Needs root (network namespaces, nftables).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from harness import OUT_DIR, cell, interrupt_on, write_json
from zone_cluster import BY_ZONE, SPILLED, Device, ZoneFleet, counters, delta, live, workers_of

from inferd.bench.load_spec import LoadSpec
from inferd.bench.loadgen import offer_load
from inferd.bench.open_loop import arrival_offsets, run_blocking
from inferd.bench.report import PhaseReport, Recorder

PHASES = ("before", "during", "after")
GROUPS = ("surviving", "lost")


class Timeline:
    """What the orchestrating thread saw, in seconds from the load's start."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.events: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, event: str, **detail: Any) -> None:
        self.events.append({"t": round(self.now(), 2), "event": event, **detail})
        print(f"  {self.now():6.2f} s  {event} {detail if detail else ''}", file=sys.stderr)

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def when(self, event: str, check: Any, until: float, poll_s: float = 0.1, **detail: Any) -> None:
        while self.now() < until:
            if check():
                self.add(event, **detail)
                return
            time.sleep(poll_s)
        self.add(f"not seen: {event}", **detail)


class Loss:
    """Cuts the last zone off at --before and heals it at --before + --down, on a thread; records when the
    fleet noticed, and each front end's work by zone at the phase bounds."""

    def __init__(self, args: argparse.Namespace, fleet: ZoneFleet) -> None:
        self.args, self.fleet = args, fleet
        self.lost = fleet.names[-1]
        self.counts: list[dict[str, dict[str, dict[str, float]] | None]] = []
        """At each phase bound, each front end's `counters` (None: not asked or no answer)."""
        self.dropped = 0
        self.tl: Timeline | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, t0: float) -> None:
        self.tl = Timeline(t0)
        self.thread = threading.Thread(target=self._run, name="zone-loss", daemon=True)
        self.thread.start()

    def _snapshot(self, cut: bool = False) -> None:
        """Each front end's work by zone so far (None for the cut-off one: it cannot be asked)."""
        away = self.fleet.front_end(self.lost) if cut else None
        self.counts.append({fe.id: None if fe is away else counters(fe) for fe in self.fleet.front_ends})

    def _run(self) -> None:
        try:
            self._scenario()
        except BaseException as exc:  # reported by main; the zone is healed by `restore`
            self.error = exc
            self.restore()

    def _scenario(self) -> None:
        a, tl, fleet, z = self.args, self.tl, self.fleet, self.lost
        assert tl is not None
        survivors = [fe for fe in fleet.front_ends if fe is not fleet.front_end(z)]
        gone = fleet.workers_in(z)
        self._snapshot()
        tl.sleep_until(a.before)
        self._snapshot()
        fleet.cut(z)
        tl.add("cut off", zone=z)
        heal_at = a.before + a.down
        for fe in survivors:
            tl.when("gave the zone's workers up", lambda fe=fe: not gone & set(workers_of(fe)), heal_at, frontend=fe.id)
        tl.sleep_until(heal_at)
        self.dropped = fleet.dropped(z)
        self._snapshot(cut=True)
        fleet.heal(z)
        tl.add("healed", zone=z, packets_dropped=self.dropped)
        end = heal_at + a.after
        lost_fe = fleet.front_end(z)
        tl.when("answers its clients again", lambda: live(lost_fe), end, frontend=lost_fe.id)
        self.counts[-1][lost_fe.id] = counters(lost_fe)  # its "after" counted from here
        for fe in survivors:
            tl.when("the zone's workers back", lambda fe=fe: gone <= set(workers_of(fe)), end, frontend=fe.id)
        tl.sleep_until(end)
        self._snapshot()

    def restore(self) -> None:
        self.fleet.heal(self.lost)


def capacity(args: argparse.Namespace, fleet: ZoneFleet) -> dict[str, float]:
    """The devices' full-batch capacity, and the fleet's answers per second under 1.5x it, offered to every
    zone alike (counted until the last answer came back)."""
    nominal = fleet.capacity_rps()
    if args.capacity_s <= 0:
        return {"nominal_rps": nominal, "measured_rps": nominal}
    rec = Recorder()
    specs = [
        LoadSpec(url=fe.url, rate=1.5 * nominal / len(fleet.names), duration_s=args.capacity_s, seed=100 + i,
                 timeout_ms=args.timeout_ms, connections=512)
        for i, fe in enumerate(fleet.front_ends)
    ]  # fmt: skip

    async def main() -> list[Any]:
        return await asyncio.gather(*(offer_load(s, arrival_offsets(s), lambda i, o: rec) for s in specs))

    offered = run_blocking(main())
    time.sleep(2.0)  # the queues drain before the run
    return {"nominal_rps": nominal, "measured_rps": rec.ok_count / max(o.elapsed_s for o in offered)}


def load(args: argparse.Namespace, fleet: ZoneFleet, rate: float, loss: Loss) -> dict[str, Any]:
    """Each zone's clients offer rate/Z to their front end; the lost zone's are redirected while it is
    seen down. Per phase and group (surviving / lost front end): a Recorder."""
    total = args.before + args.down + args.after
    bounds = (args.before, args.before + args.down)
    recorders = {(p, g): Recorder(slo_ms=args.slo_ms) for p in PHASES for g in GROUPS}
    away = (args.before + args.failover_s, args.before + args.down + args.failover_s)
    fes = fleet.front_ends
    survivors = fes[:-1]

    def phase(offset: float) -> str:
        return "before" if offset < bounds[0] else "during" if offset < bounds[1] else "after"

    plans: list[tuple[LoadSpec, list[float], str]] = []  # spec, offsets, group
    for i, fe in enumerate(fes):
        spec = LoadSpec(
            url=fe.url, rate=rate / len(fes), duration_s=total, seed=i + 1, slo_ms=args.slo_ms,
            timeout_ms=args.timeout_ms, connections=512,
        )  # fmt: skip
        offsets = arrival_offsets(spec)
        if fe is not fes[-1]:
            plans.append((spec, offsets, "surviving"))
            continue
        home = [o for o in offsets if not away[0] <= o < away[1]]
        redirected = [o for o in offsets if away[0] <= o < away[1]]
        plans.append((spec, home, "lost"))
        for k, other in enumerate(survivors):
            plans.append((replace(spec, url=other.url, seed=50 + k), redirected[k :: len(survivors)], "surviving"))

    def recorder_for(group: str) -> Any:
        return lambda i, offset: recorders[phase(offset), group]

    async def main() -> None:
        await asyncio.gather(*(
            offer_load(s, o, recorder_for(g), on_start=loss.start if n == 0 else None)
            for n, (s, o, g) in enumerate(plans)
        ))  # fmt: skip

    run_blocking(main())
    windows = {"before": args.before, "during": args.down, "after": args.after}
    out: dict[str, Any] = {}
    for p in PHASES:
        out[p] = {g: PhaseReport.from_recorder(recorders[p, g], windows[p]).to_dict() for g in GROUPS}
        out[p]["goodput_rps"] = sum(recorders[p, g].within_slo for g in GROUPS) / windows[p]
        out[p]["offered_rps"] = sum(recorders[p, g].sent for g in GROUPS) / windows[p]
    return out


def in_zone(loss: Loss) -> dict[str, dict[str, Any]]:
    """Per phase and front end: the share of its work served in its own zone, and what spilled."""
    out: dict[str, dict[str, Any]] = {}
    for p, (lo, hi) in zip(PHASES, ((0, 1), (1, 2), (2, 3)), strict=True):
        row: dict[str, Any] = {}
        for fe in loss.fleet.front_ends:
            if len(loss.counts) <= hi:
                continue
            now, was = loss.counts[hi][fe.id], loss.counts[lo][fe.id]
            if now is None or was is None:
                row[fe.id] = None
                continue
            d, s, r, f = (delta(now[k], was[k]) or {} for k in (BY_ZONE, SPILLED, "retried", "failed"))
            zone = fe.id.removeprefix("fe-")
            served = sum(d.values())
            row[fe.id] = {
                "served": served, "in_zone": d.get(zone, 0.0) / served if served else None,
                "spilled": sum(s.values()), "by_zone": d, "retried": r.get("", 0.0), "failed_batches": f.get("", 0.0),
            }  # fmt: skip
        out[p] = row
    return out


def print_tables(run: dict[str, Any], args: argparse.Namespace) -> None:
    c = run["capacity"]
    print(f"capacity: {c['measured_rps']:.0f} answers/s measured ({c['nominal_rps']:.0f} the devices' full-batch "
          f"capacity); offered {run['rate_rps']:.0f} req/s ({args.load:.0%}); zone {run['lost_zone']} cut off "
          f"{args.before:g}-{args.before + args.down:g} s\n")  # fmt: skip
    print(f"| phase | s | offered/s | goodput/s (<= {args.slo_ms:g} ms) | surviving: ok | p50 ms | p99 ms | "
          "surviving: failures | lost zone's front end: sent | ok | failures |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|")
    windows = {"before": args.before, "during": args.down, "after": args.after}

    def failures(p: dict[str, Any]) -> str:
        causes = {**p["errors"], **{k: v for k, v in p["mismatch_kinds"].items() if v}}
        return ", ".join(f"{k}: {v}" for k, v in causes.items() if v) or "0"

    for name in PHASES:
        ph = run["load"][name]
        s, lost = ph["surviving"], ph["lost"]
        lat = s["latency_ms"]
        print(
            f"| {name} | {windows[name]:g} | {ph['offered_rps']:.1f} | {ph['goodput_rps']:.1f} | {s['ok']:,} | "
            f"{cell(lat.get('p50'))} | {cell(lat.get('p99'))} | {failures(s)} | {lost['sent']:,} | {lost['ok']:,} | "
            f"{failures(lost)} |"
        )
    print("\n| phase | front end | served in its own zone | spilled | work by zone | items retried | batches failed |")
    print("|---|---|---:|---:|---|---:|---:|")
    for name, row in run["in_zone"].items():
        for fe, r in row.items():
            if r is None:
                print(f"| {name} | {fe} | (did not answer) | | | | |")
                continue
            share = "-" if r["in_zone"] is None else f"{r['in_zone']:.1%}"
            work = ", ".join(f"{z}: {v:.0f}" for z, v in r["by_zone"].items())
            print(f"| {name} | {fe} | {share} | {r['spilled']:.0f} | {work} | {r['retried']:.0f} | {r['failed_batches']:.0f} |")
    print("\n```")
    for e in run["events"]:
        print(f"{e['t']:7.2f} s  {e['event']}  " + ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "event")))
    print("```")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zones", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="sim workers per zone")
    ap.add_argument("--load", type=float, default=0.6, help="share of the fleet's capacity offered")
    ap.add_argument("--before", type=float, default=20.0)
    ap.add_argument("--down", type=float, default=30.0)
    ap.add_argument("--after", type=float, default=30.0)
    ap.add_argument("--failover-s", type=float, default=5.0, help="until the lost zone's clients go elsewhere")
    ap.add_argument("--slo-ms", type=float, default=500.0)
    ap.add_argument("--timeout-ms", type=float, default=3000.0)
    ap.add_argument("--capacity-s", type=float, default=8.0, help="0: the devices' full-batch capacity")
    ap.add_argument("--base-ms", type=float, default=40.0)
    ap.add_argument("--per-item-ms", type=float, default=5.0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-wait-ms", type=float, default=2.0, help="the batching wait (part of the load spill's floor)")
    args = ap.parse_args()
    if not 2 <= args.zones <= 6 or not 1 <= args.workers <= 4 or not 0 < args.load <= 1.5:
        raise SystemExit("--zones within 2..6, --workers within 1..4, --load within (0, 1.5]")
    if args.before + args.down + args.after > 300 or args.failover_s >= args.down:
        raise SystemExit("at most 300 s in all, and --failover-s shorter than --down")
    interrupt_on(signal.SIGTERM, signal.SIGHUP)
    log_dir = OUT_DIR / "zone_loss"
    log_dir.mkdir(parents=True, exist_ok=True)
    device = Device(args.base_ms, args.per_item_ms, args.max_batch, args.max_wait_ms)
    started = time.strftime("%H:%M:%S")
    try:
        with ZoneFleet(args.zones, args.workers, device, log_dir) as fleet:
            cap = capacity(args, fleet)
            rate = args.load * min(cap["nominal_rps"], cap["measured_rps"])  # a slower machine: what it does
            loss = Loss(args, fleet)
            try:
                result = load(args, fleet, rate, loss)
                if loss.thread is not None:
                    loss.thread.join(60.0)
            finally:
                loss.restore()
            if loss.error is not None:
                raise loss.error
            run = {
                "started": started, "args": vars(args), "capacity": cap, "rate_rps": rate, "lost_zone": loss.lost,
                "load": result, "in_zone": in_zone(loss), "events": loss.tl.events if loss.tl else [],
                "packets_dropped": loss.dropped,
            }  # fmt: skip
    except TimeoutError as exc:
        print(f"zone_loss: {exc}", file=sys.stderr)
        return 2
    write_json(OUT_DIR / "zone_loss.json", run)
    print_tables(run, args)
    wrong = sum(run["load"][p][g]["mismatched"] for p in PHASES for g in GROUPS)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
