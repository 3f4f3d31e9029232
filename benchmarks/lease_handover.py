"""Lease handover: from the SIGKILL of the front end holding the lease "decider" to another acting.

N `inferd serve` front ends (--frontends, 3) on 127.0.0.1, 127.0.0.2, ... share one redis-server
(`--store redis://...`, started and stopped here), each with one local `sim` worker. Each run:
1. waits for exactly one front end with `inferd_cluster_lease_holder 1` on its /metrics, and for a scale
   asked of every other one to be carried out (forwarded to the holder: every front end knows it);
2. reads the lease's remaining time in Redis (PTTL of `{inferd}:lease:decider`) and SIGKILLs the holder;
3. every --poll-ms (50) asks each survivor's /metrics whether it holds the lease, and each survivor's
   admin API for a scale to its current count (`POST /admin/models/sim/scale?workers=1`: a change that
   needs the lease, refused with 503 while no live front end holds it, forwarded to the holder by the
   others), until one showed the lease and every survivor's scale succeeded, or --give-up-s;
4. stops what is left of the killed front end (its worker) and starts a new one in its place.

Reported per run: the lease's time left at the kill, when a survivor first showed
`inferd_cluster_lease_holder 1` ("holder"), when the scale asked of that one first succeeded ("acting"),
and when the last survivor's scale succeeded (forwarded); then min / median / max over the runs. Each
--ttls value is a fresh set of front ends with `[cluster] lease_ttl_s` set to it.

    .venv/bin/python benchmarks/lease_handover.py [--frontends 3] [--runs 5] [--ttls 5,2] [--poll-ms 50]

Writes .bench/lease_handover.json and prints markdown tables. Exits 2 when a front end could not be
started or a run never got a new holder.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness import OUT_DIR, ServerNotReady, cell, interrupt_on, write_json
from store_cluster import FrontEnd, Ports, RedisProcess, cluster_config, wait_until

LEASE_KEY = "{inferd}:lease:decider"
"""The lease's key in Redis ([cluster] name "inferd", cluster/redis_store.py)."""

SCALE = "/admin/models/sim/scale?workers=1"
"""A change that needs the lease and starts nothing (each front end runs one local worker)."""


def pttl(port: int, key: str) -> int:
    """Redis PTTL of `key` in ms (-2: no such key, -1: no expiry)."""
    with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
        sock.sendall(f"PTTL {key}\r\n".encode())
        reply = sock.recv(64).decode()
    if not reply.startswith(":"):
        raise RuntimeError(f"PTTL {key}: {reply!r}")
    return int(reply[1:].strip())


def start_all(frontends: list[FrontEnd]) -> None:
    """Start them together (each start takes seconds), then wait for each to be ready."""
    for fe in frontends:
        fe.start()
    for fe in frontends:
        fe.ready_s = fe.wait_ready()


def settle(frontends: list[FrontEnd], timeout_s: float) -> FrontEnd:
    """The one holder, once exactly one shows it and a scale asked of each other one is carried out."""
    found: list[FrontEnd] = []

    def one_holder() -> bool:
        found[:] = [fe for fe in frontends if fe.holds()]
        return len(found) == 1

    wait_until("exactly one lease holder", one_holder, timeout_s, poll_s=0.2)
    (holder,) = found
    for fe in frontends:
        wait_until(f"a scale asked of {fe.name} carried out", lambda fe=fe: fe.post_admin(SCALE)[0] == 200, timeout_s, 0.2)
    if not holder.holds():
        raise RuntimeError("the holder changed while the front ends settled")
    return holder


def one_run(frontends: list[FrontEnd], redis: RedisProcess, args: argparse.Namespace) -> dict[str, Any]:
    holder = settle(frontends, args.settle_s)
    survivors = [fe for fe in frontends if fe is not holder]
    left_ms = pttl(redis.port, LEASE_KEY)
    t0 = time.monotonic()
    os.kill(holder.pid, signal.SIGKILL)
    holder_at: dict[str, float] = {}
    scale_ok_at: dict[str, float] = {}
    refusals: dict[str, dict[int, int]] = {fe.id: {} for fe in survivors}
    first_error: dict[str, str] = {}
    last_error: dict[str, str] = {}
    while time.monotonic() - t0 < args.give_up_s and (len(scale_ok_at) < len(survivors) or not holder_at):
        round_start = time.monotonic()
        for fe in survivors:
            if fe.id not in holder_at and fe.holds():
                holder_at[fe.id] = time.monotonic() - t0
            if fe.id not in scale_ok_at:
                status, answer, _ = fe.post_admin(SCALE, timeout_s=10.0)
                if status == 200:
                    scale_ok_at[fe.id] = time.monotonic() - t0
                else:
                    refusals[fe.id][status] = refusals[fe.id].get(status, 0) + 1
                    said = str(answer.get("error", answer))[:200]
                    first_error.setdefault(fe.id, said)
                    last_error[fe.id] = said
        time.sleep(max(0.0, args.poll_ms / 1000 - (time.monotonic() - round_start)))
    new = min(holder_at, key=holder_at.__getitem__) if holder_at else None
    return {
        "killed": holder.id,
        "lease_left_ms": left_ms,
        "new_holder": new,
        "holder_s": holder_at.get(new) if new else None,
        "acting_s": scale_ok_at.get(new) if new else None,
        "all_scaled_s": max(scale_ok_at.values()) if len(scale_ok_at) == len(survivors) else None,
        "holder_at": holder_at,
        "scale_ok_at": scale_ok_at,
        "refusals": {k: {str(s): n for s, n in v.items()} for k, v in refusals.items()},
        "first_refusal": first_error,
        "last_refusal": last_error,
    }


def replace(frontends: list[FrontEnd], killed_id: str, make: Any) -> list[FrontEnd]:
    """Stop what is left of the killed front end and start a new one in its place."""
    out = []
    for i, fe in enumerate(frontends):
        if fe.id == killed_id:
            fe.stop()
            fe = make(i)
            fe.start()
            fe.ready_s = fe.wait_ready()
        out.append(fe)
    return out


def for_ttl(ttl: float, args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    ports = Ports()
    config = log_dir / f"inferd-ttl{ttl:g}.toml"
    config.write_text(cluster_config(lease_ttl_s=ttl))
    rows: list[dict[str, Any]] = []
    with RedisProcess(ports.take(), log_path=log_dir / f"redis-ttl{ttl:g}.log") as redis:

        def make(i: int) -> FrontEnd:
            return FrontEnd(i, redis.url, config, ports, log_dir)

        frontends = [make(i) for i in range(args.frontends)]
        try:
            start_all(frontends)
            for run in range(args.runs):
                row = one_run(frontends, redis, args) | {"ttl_s": ttl, "run": run + 1}
                rows.append(row)
                print(
                    f"  ttl {ttl:g} run {run + 1}: lease left {row['lease_left_ms']} ms, holder at "
                    f"{cell(row['holder_s'], 3)} s, acting at {cell(row['acting_s'], 3)} s",
                    file=sys.stderr,
                )
                if row["new_holder"] is None:
                    break
                if run + 1 < args.runs:
                    frontends = replace(frontends, row["killed"], make)
        finally:
            for fe in frontends:
                fe.stop()
    return rows


def summary(rows: list[dict[str, Any]], field: str) -> str:
    values = [r[field] for r in rows if r[field] is not None]
    if not values:
        return "-"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def print_tables(rows: list[dict[str, Any]], frontends: int) -> None:
    print(f"| lease ttl s | run | lease left at the kill, s | new holder shows 1, s | its scale answers 200, s "
          f"| last of the {frontends - 1} survivors' scales, s | refusals before (status: count) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        refused = "; ".join(
            ", ".join(f"{s}: {n}" for s, n in v.items()) for v in r["refusals"].values() if v
        )
        print(
            f"| {r['ttl_s']:g} | {r['run']} | {r['lease_left_ms'] / 1000:.2f} | {cell(r['holder_s'], 2)} | "
            f"{cell(r['acting_s'], 2)} | {cell(r['all_scaled_s'], 2)} | {refused or '-'} |"
        )
    print("\n| lease ttl s | runs | holder shows 1, s (min / median / max) | acting (scale 200), s | lease left at the kill, s |")
    print("|---:|---:|---|---|---|")
    for ttl in sorted({r["ttl_s"] for r in rows}, reverse=True):
        mine = [r | {"left_s": r["lease_left_ms"] / 1000} for r in rows if r["ttl_s"] == ttl]
        print(
            f"| {ttl:g} | {len(mine)} | {summary(mine, 'holder_s')} | {summary(mine, 'acting_s')} | "
            f"{summary(mine, 'left_s')} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frontends", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5, help="handovers per ttl (at most 20)")
    ap.add_argument("--ttls", default="5,2", help="[cluster] lease_ttl_s of each set of runs")
    ap.add_argument("--poll-ms", type=float, default=50.0)
    ap.add_argument("--give-up-s", type=float, default=30.0, help="a run without a new holder by then fails")
    ap.add_argument("--settle-s", type=float, default=30.0, help="most time to wait for one holder before a run")
    args = ap.parse_args()
    if not 2 <= args.frontends <= 8 or not 1 <= args.runs <= 20:
        raise SystemExit("--frontends must be within 2..8 and --runs within 1..20")
    interrupt_on(signal.SIGTERM, signal.SIGHUP)
    log_dir = OUT_DIR / "lease_handover"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        for ttl in (float(t) for t in args.ttls.split(",") if t):
            rows += for_ttl(ttl, args, log_dir)
    except (ServerNotReady, TimeoutError) as exc:
        print(f"lease_handover: {exc}", file=sys.stderr)
        write_json(OUT_DIR / "lease_handover.json", {"rows": rows, "args": vars(args), "failed": str(exc)})
        return 2
    print_tables(rows, args.frontends)
    write_json(OUT_DIR / "lease_handover.json", {"rows": rows, "args": vars(args)})
    return 2 if any(r["new_holder"] is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
