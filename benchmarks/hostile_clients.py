"""The front door under hostile clients and floods, with the load generator on the same machine:

* slowloris: normal clients' latency (open-loop, --normal-rate on `sim`) alone, then while --attackers
  connections from 127.0.0.2-127.0.0.255 trickle one header line every 2 s (reconnecting whenever the
  server closes them; server defaults: header_timeout_s = 10);
* flood past the device: --device-rate req/s for --flood-s on a sim of ~100 req/s (base_ms = 200,
  max_batch_size = 20, one worker), each request sending its 5 s deadline (X-Request-Timeout-Ms):
  statuses, refusal latency, answers in the window, RSS growth;
* flood past the front end: --front-rate req/s against admission_rate_per_s = --admission-rate, and
  against max_connections = --max-connections: statuses, refusal latency, timeouts.

    .venv/bin/python benchmarks/hostile_clients.py [--flood-s 60] [--attackers 500]

Writes .bench/hostile_clients.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import OUT_DIR, InferdServer, run_fields, write_json
from procfs import RssSampler, cpu_seconds_since, rss_mib

from inferd.bench.loadgen import LoadSpec, run_load_blocking

SERVE = ("--no-admin", "--log-level", "WARNING")
SLOW_SIM = """builtin = "sim"
workers = 1
max_batch_size = 20
[params]
base_ms = 200.0
per_item_ms = 0.0
"""
"""~100 req/s: a batch of up to 20 every 200 ms, on one worker; queue and admission at their defaults."""


def listen_overflows() -> int:
    """Connections the kernel dropped from full accept queues, machine-wide (this network namespace)."""
    names, values = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()[:2]]
    return int(values[names.index("ListenOverflows")])


def load(
    server: InferdServer,
    rate: float,
    duration_s: float,
    model: str = "sim",
    connections: int = 2000,
    send_deadline: bool = False,
) -> dict[str, Any]:
    """Open-loop load (5 s client deadline); with the server's CPU seconds (server and workers), the
    generator's, and the accept-queue overflows meanwhile."""
    spec = LoadSpec(
        url=server.url,
        model=model,
        rate=rate,
        duration_s=duration_s,
        seed=int(rate),
        connections=connections,
        send_deadline=send_deadline,
    )
    before, overflows = server.cpu_ticks(), listen_overflows()
    report = run_load_blocking(spec)
    m = report.measured
    return {
        "offered": round(m.offered_rps, 1),
        **run_fields(m, "achieved_rps", "rejection_ms", "send_lag_ms"),
        "sent": report.sent,
        "server_cpu_s": round(cpu_seconds_since(before, server.pids()), 2),
        "generator_cpu_s": round(report.generator_cpu_s, 2),
        "listen_overflows": listen_overflows() - overflows,
    }


# slowloris: the attacker runs in its own process (this file with --attack), so that its sockets and
# loop do not slow the load generator's


async def _trickle(ip: str, port: int, until: float, lives: list[float], statuses: list[str]) -> None:
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ip, 0))
        except OSError:
            statuses.append("connect_failed")
            await asyncio.sleep(1.0)
            continue
        got = b""
        try:
            writer.write(b"POST /v2/models/sim/infer HTTP/1.1\r\nHost: x\r\n")
            for i in range(10_000):
                if time.monotonic() >= until:
                    break
                writer.write(b"X-Slow-%d: y\r\n" % i)
                try:
                    async with asyncio.timeout(2.0):
                        chunk = await reader.read(4096)
                except TimeoutError:
                    continue
                got += chunk
                if not chunk:
                    lives.append(time.monotonic() - t0)
                    statuses.append(got[9:12].decode() or "closed")
                    break
        except ConnectionError:
            lives.append(time.monotonic() - t0)
            statuses.append("reset")
        finally:
            writer.close()


async def attack(port: int, conns: int, seconds: float) -> dict[str, Any]:
    until = time.monotonic() + seconds
    lives: list[float] = []
    statuses: list[str] = []
    async with asyncio.TaskGroup() as tg:
        for i in range(conns):
            tg.create_task(_trickle(f"127.0.0.{2 + i % 254}", port, until, lives, statuses))
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    return {
        "closed_by_server": len(lives),
        "life_s_median": round(statistics.median(lives), 2) if lives else None,
        "life_s_max": round(max(lives), 2) if lives else None,
        "answers": counts,
    }


def slowloris(args: argparse.Namespace) -> dict[str, Any]:
    with InferdServer("--model", "sim", *SERVE, name="hostile-slowloris", grace_s=30.0) as server:
        load(server, args.normal_rate, 3.0)  # warm-up
        baseline = load(server, args.normal_rate, args.normal_s)
        seconds = args.normal_s + 15.0
        cmd = [sys.executable, __file__, "--attack", str(server.port), str(args.attackers), str(seconds)]
        attacker = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(3.0)  # every attacker connected and trickling
            attacked = load(server, args.normal_rate, args.normal_s)
            out, _ = attacker.communicate(timeout=seconds + 30)
        finally:
            if attacker.poll() is None:
                attacker.kill()
                attacker.wait()
    p99 = (baseline["latency_ms"]["p99"], attacked["latency_ms"]["p99"])
    ratio = None if None in p99 else round(p99[1] / p99[0], 2)
    return {"baseline": baseline, "attacked": attacked, "p99_ratio": ratio, "attack": json.loads(out)}


def flood_device(args: argparse.Namespace) -> dict[str, Any]:
    models = {"slowsim": SLOW_SIM}
    with InferdServer(*SERVE, models=models, name="hostile-device", grace_s=30.0) as server:
        load(server, args.device_rate, 5.0, model="slowsim", send_deadline=True)  # warm-up
        pids = server.pids()
        before = {"server": rss_mib([server.pid]), "all": rss_mib(pids)}
        sampler = RssSampler({server.pid})
        sampler.start()
        result = load(server, args.device_rate, args.flood_s, model="slowsim", send_deadline=True)
        peak = sampler.finish()
        after = {"server": rss_mib([server.pid]), "all": rss_mib(server.pids())}
    result["rss_mib"] = {"before": before, "after": after, "server_peak": round(peak, 1)}
    result["rss_growth_mib"] = round(after["server"] - before["server"], 1)
    return result


def flood_front(args: argparse.Namespace, connections: int, *limit: str) -> dict[str, Any]:
    with InferdServer("--model", "sim", *SERVE, *limit, name="hostile-front", grace_s=30.0) as server:
        load(server, args.front_rate, 2.0, connections=connections)  # warm-up
        result = load(server, args.front_rate, args.front_s, connections=connections)
    result["limit"] = " ".join(limit)
    result["client_connections"] = connections
    return result


def summary(results: dict[str, Any]) -> None:
    s = results["slowloris"]
    print("| slowloris | normal p50 ms | normal p99 ms | ok | errors |")
    print("|---|---|---|---|---|")
    for name in ("baseline", "attacked"):
        r = s[name]
        lat = r["latency_ms"]
        print(f"| {name} | {lat['p50']} | {lat['p99']} | {r['ok']} | {r['errors']} |")
    print(f"\np99 under attack / baseline: {s['p99_ratio']}; attack: {s['attack']}\n")
    d = results["flood_device"]
    print(
        f"flood past the device: offered {d['offered']} req/s, ok {d['ok']} ({d['achieved_rps']:.1f}/s), "
        f"errors {d['errors']}, refusal p50/p99 {d['rejection_ms']['p50']}/{d['rejection_ms']['p99']} ms, "
        f"RSS growth {d['rss_growth_mib']} MiB ({d['rss_mib']})\n"
    )
    print("| flood past the front end | offered req/s | ok/s | errors | refusal p50 ms | refusal p99 ms |")
    print("|---|---|---|---|---|---|")
    for r in results["flood_front"]:
        rej = r["rejection_ms"]
        print(
            f"| {r['limit']} | {r['offered']} | {r['achieved_rps']:.0f} | {r['errors']} | "
            f"{rej['p50']} | {rej['p99']} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attackers", type=int, default=500)
    ap.add_argument("--normal-rate", type=float, default=200.0)
    ap.add_argument("--normal-s", type=float, default=20.0)
    ap.add_argument("--device-rate", type=float, default=1000.0)
    ap.add_argument("--flood-s", type=float, default=60.0)
    ap.add_argument("--front-rate", type=float, default=5000.0)
    ap.add_argument("--front-s", type=float, default=10.0)
    ap.add_argument("--admission-rate", type=float, default=500.0)
    ap.add_argument("--max-connections", type=int, default=64)
    ap.add_argument("--attack", nargs=3, metavar=("PORT", "CONNS", "SECONDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.attack:
        port, conns, seconds = args.attack
        print(json.dumps(asyncio.run(attack(int(port), int(conns), float(seconds)))))
        return 0
    results: dict[str, Any] = {"command": " ".join(sys.argv)}
    results["slowloris"] = slowloris(args)
    results["flood_device"] = flood_device(args)
    results["flood_front"] = [
        flood_front(args, 2000, "--admission-rate-per-s", str(args.admission_rate)),
        flood_front(args, 10 * args.max_connections, "--max-connections", str(args.max_connections)),
    ]
    write_json(OUT_DIR / "hostile_clients.json", results)
    summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
