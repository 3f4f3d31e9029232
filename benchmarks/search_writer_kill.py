"""A search index's writer SIGKILLed under writes: the time to the next acknowledged write.

Two set-ups (`--mode`):
- `frontends`: one `inferd serve --frontends 2` (one host). The writer of index `docs` is front end 0;
  its SIGKILL is followed by the parent starting it again, which takes the writer lease back.
- `hosts`: two `inferd serve` front ends on 127.0.0.1 and 127.0.0.2 sharing one redis-server (started
  and stopped here, no persistence), each with its own ports, data folder and local replica workers,
  the same INFERD_JOIN_TOKEN: one server, as on two hosts; and two replica workers of their own
  (`inferd worker --model docs --connect A,B`, as on a worker host) joined to both. The writer is the
  holder of the lease `search-writer/docs` (read in Redis); its SIGKILL (the front end and its local
  workers) leaves the other front end to take the lease over once it expires (`[cluster] lease_ttl_s`,
  --ttl) and the shards over from the freshest replica it reaches. (The workers of their own matter: a
  front end's local workers join the front ends whose records they find when they start, so those of
  the front end that started first may never join the other; were the writer's host the only one whose
  replicas held the writes, nobody could take the index over, and it would refuse writes.)

Each run starts a fresh server with index `docs` (2 shards x 2 replicas, embedder "none": lexical only),
then --clients threads write one document per request (new connection each; on `hosts` spread over both
front ends), each document's id unique. After --before-s it SIGKILLs the writer and goes on writing
until a write sent after the kill is acknowledged (200) and --after-s more have passed. Reported per
run: how long from the kill until the first write sent after it was acknowledged ("next ack"), how many
writes got 503 meanwhile (with their Retry-After), and other failures; then whether every acknowledged
document is found exactly once (a GET of each on a surviving front end, and one lexical search listing
every document: no id twice, none acknowledged missing).

    .venv/bin/python benchmarks/search_writer_kill.py [--mode frontends|hosts] [--runs 3] [--clients 4]
        [--ttl 5]

Writes .bench/search_writer_kill-MODE.json and prints a markdown table. Exits 2 when a server could not
be started, or when an acknowledged document was lost or found twice.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import (
    OUT_DIR,
    InferdServer,
    ServerNotReady,
    ServerProcess,
    cell,
    inferd_command,
    interrupt_on,
    write_json,
)
from store_cluster import JOIN_TOKEN, Ports, RedisProcess, wait_until

INDEX = """
kind = "search"
[search]
shards = 2
replicas = 2
embedder = "none"
"""
WORD = "benchword"
"""In every document: one search for it lists them all."""


def call(url: str, method: str = "GET", body: Any = None, timeout_s: float = 30.0) -> tuple[int, Any, str]:
    """(status, JSON body, Retry-After); status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null"), r.headers.get("Retry-After", "")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null"), exc.headers.get("Retry-After", "")
    except (OSError, ValueError) as exc:
        return 0, {"error": repr(exc)}, ""


@dataclass
class Outcome:
    sent_at: float
    done_at: float
    status: int
    doc: str
    retry_after: str = ""


@dataclass
class Writers:
    """--clients threads writing one new document each request until `stop`."""

    urls: list[str]
    clients: int
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, client: int) -> None:
        n = 0
        while not self.stop.is_set():
            url = self.urls[(client + n) % len(self.urls)]
            doc = f"c{client}n{n}"  # one token: a search for it finds it
            body = {"documents": [{"id": doc, "text": f"{WORD} {doc}"}]}
            sent = time.monotonic()
            status, _, retry = call(f"{url}/v1/indexes/docs/documents", "POST", body, 60.0)
            with self.lock:
                self.outcomes.append(Outcome(sent, time.monotonic(), status, doc, retry))
            n += 1
            if status != 200:
                time.sleep(0.05)  # a refused write is tried again shortly, as a client would

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.run, args=(c,), daemon=True) for c in range(self.clients)]
        for t in threads:
            t.start()
        return threads


class Server(InferdServer):
    """One `inferd serve` of the run (all of it, or one front end of `hosts`)."""

    def __init__(self, name: str, args: list[str], host: str = "127.0.0.1", env: dict[str, str] | None = None) -> None:
        super().__init__(
            *args, "--host", host, "--log-level", "INFO", "--shutdown-grace-s", "0",
            name=name, models={"docs": INDEX}, env=env or {}, ready_timeout_s=120.0,
        )  # fmt: skip
        self.url = f"http://{host}:{self.port}"
        self.id = f"{host}:{self.port}"
        port = args[args.index("--worker-port") + 1] if "--worker-port" in args else None
        self.worker_address = f"{host}:{port}" if port else None
        """Where workers on other hosts join it (HOST:PORT); None: none."""


def owner_pid(parent: int) -> int:
    """Front end 0 of `--frontends 2`: the child of the parent that has children (the replica workers)."""
    children = [int(p) for p in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
    with_children = [p for p in children if Path(f"/proc/{p}/task/{p}/children").read_text().split()]
    if len(with_children) != 1:
        raise RuntimeError(f"front end 0 not found among {children}")
    return with_children[0]


def redis_holder(port: int, lease: str) -> str | None:
    """The holder of `lease` in Redis ([cluster] name "inferd": key {inferd}:lease:LEASE, a hash)."""
    with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
        sock.sendall(f"HGET {{inferd}}:lease:{lease} holder\r\n".encode())
        reply = sock.recv(256).decode()
    if reply.startswith("$-1"):
        return None
    return reply.split("\r\n")[1]


def one_run(mode: str, clients: int, before_s: float, after_s: float, ttl: float, log_dir: Path) -> dict[str, Any]:
    config = f"[cluster]\nlease_ttl_s = {ttl}\n"
    servers: list[Server] = []
    workers: list[ServerProcess] = []
    redis: RedisProcess | None = None
    try:
        cfg = log_dir / "inferd.toml"
        cfg.write_text(config)
        if mode == "frontends":
            servers.append(Server("frontends", ["--frontends", "2", "--config", str(cfg)]))
            servers[0].start()
            servers[0].wait_ready()
            urls = [servers[0].url]
        else:
            ports = Ports()
            redis = RedisProcess(ports.take(), log_dir / "redis.log")
            redis.start()
            redis.wait_ready()
            for i in range(2):
                host = f"127.0.0.{i + 1}"
                args = [
                    "--store", redis.url, "--config", str(cfg), "--worker-host", host,
                    "--worker-port", str(ports.take()),
                ]  # fmt: skip
                servers.append(Server(f"host-{i}", args, host, {"INFERD_JOIN_TOKEN": JOIN_TOKEN}))
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready()
            connect = ",".join(s.worker_address for s in servers)
            for i in range(2):
                worker = ServerProcess(
                    inferd_command("worker", "--connect", connect, "--model", "docs", "--worker-id", f"w{i}"),
                    name=f"worker-{i}", env={"INFERD_JOIN_TOKEN": JOIN_TOKEN},
                )
                worker.start()
                workers.append(worker)
            urls = [s.url for s in servers]
        for url in urls:  # every front end takes writes before the clock starts
            wait_until(f"a write through {url}", lambda url=url: call(
                f"{url}/v1/indexes/docs/documents", "POST", {"documents": [{"id": "warm", "text": WORD}]}
            )[0] == 200, 60.0, 0.2)  # fmt: skip
        if mode == "hosts":  # the workers of their own serve a shard, as every front end sees them
            def joined(url: str) -> bool:
                _, index, _ = call(f"{url}/v1/indexes/docs")
                rows = [r for shard in index.get("workers", []) for r in shard]
                return {r["worker"] for r in rows if r["applied_seq"] >= 0} >= {"w0", "w1"}

            for url in urls:
                wait_until(f"w0 and w1 serving on {url}", lambda url=url: joined(url), 60.0, 0.2)
        writers = Writers(urls, clients)
        threads = writers.start()
        time.sleep(before_s)
        if mode == "frontends":
            victim_pid, survivors = owner_pid(servers[0].proc.pid), urls
        else:
            assert redis is not None
            holder = redis_holder(redis.port, "search-writer/docs")
            (victim,) = [s for s in servers if s.id == holder]
            victim_pid, survivors = -victim.pid, [s.url for s in servers if s is not victim]
            writers.urls = survivors  # a client of the killed front end moves to another
        killed_at = time.monotonic()
        if victim_pid > 0:
            os.kill(victim_pid, signal.SIGKILL)
        else:  # its process group: the front end and its local workers, as a host lost
            os.killpg(-victim_pid, signal.SIGKILL)

        def acked_after() -> bool:
            with writers.lock:
                return any(o.status == 200 and o.sent_at >= killed_at for o in writers.outcomes)

        wait_until("a write acknowledged after the kill", acked_after, 120.0, 0.02)
        time.sleep(after_s)
        writers.stop.set()
        for t in threads:
            t.join(90)
        return report(writers.outcomes, killed_at, survivors[0])
    finally:
        for p in [*workers, *servers]:
            p.stop()
        if redis is not None:
            redis.stop()


def report(outcomes: list[Outcome], killed_at: float, survivor: str) -> dict[str, Any]:
    after = [o for o in outcomes if o.sent_at >= killed_at]
    first = min(o.done_at for o in after if o.status == 200)
    gap = [o for o in outcomes if o.done_at >= killed_at and o.done_at <= first]
    acked = {o.doc for o in outcomes if o.status == 200}
    tried = {o.doc for o in outcomes}
    found_times: dict[int, int] = {}
    for d in sorted(acked):  # a search for its own token: found once, and not twice
        status, body, _ = call(f"{survivor}/v1/indexes/docs/search", "POST", {"query": d, "k": 10, "mode": "lexical"})
        times = [h["id"] for h in body.get("hits", [])].count(d) if status == 200 else -1
        found_times[times] = found_times.get(times, 0) + 1
    missing = sum(1 for d in acked if call(f"{survivor}/v1/indexes/docs/documents/{d}")[0] != 200)
    _, index, _ = call(f"{survivor}/v1/indexes/docs")
    return {
        "next_ack_s": first - killed_at,
        "writes": len(outcomes),
        "acked": len(acked),
        "refused_503": sum(1 for o in gap if o.status == 503),
        "retry_after": sorted({o.retry_after for o in gap if o.status == 503}),
        "no_answer": sum(1 for o in outcomes if o.status == 0),
        "other_failures": sorted({o.status for o in outcomes if o.status not in (0, 200, 503)}),
        "searched_found": {str(k): v for k, v in sorted(found_times.items())},
        "twice": sum(v for k, v in found_times.items() if k > 1),
        "acked_not_in_search": sum(v for k, v in found_times.items() if k < 1),
        "acked_not_found": missing,
        "documents": index.get("documents"),
        "ids_tried": len(tried) + 1,  # and "warm"
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("frontends", "hosts"), default="frontends")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--before-s", type=float, default=3.0)
    ap.add_argument("--after-s", type=float, default=2.0)
    ap.add_argument("--ttl", type=float, default=5.0, help="[cluster] lease_ttl_s")
    args = ap.parse_args()
    interrupt_on(signal.SIGINT, signal.SIGTERM)
    log_dir = OUT_DIR / "search_writer_kill"
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        for r in range(args.runs):
            runs.append(one_run(args.mode, args.clients, args.before_s, args.after_s, args.ttl, log_dir))
            print(f"run {r + 1}: {runs[-1]}", flush=True)
    except (ServerNotReady, TimeoutError) as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return 2
    write_json(OUT_DIR / f"search_writer_kill-{args.mode}.json", {"args": vars(args), "runs": runs})
    print("\n| run | next ack s | writes | acked | 503 meanwhile | Retry-After | no answer | acked lost | found twice |"
          " documents (acked..tried) |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for i, r in enumerate(runs, 1):
        lost = r["acked_not_found"] + r["acked_not_in_search"]
        print(
            f"| {i} | {cell(r['next_ack_s'], 2)} | {r['writes']} | {r['acked']} | {r['refused_503']} | "
            f"{','.join(r['retry_after']) or '-'} | {r['no_answer']} | {lost} | {r['twice']} | "
            f"{r['documents']} ({r['acked']}..{r['ids_tried']}) |"
        )
    gaps = [r["next_ack_s"] for r in runs]
    print(f"\nnext ack after the kill: min {min(gaps):.2f} s, median {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s")
    bad = any(
        r["acked_not_found"] or r["acked_not_in_search"] or r["twice"] or not r["acked"] <= r["documents"] <= r["ids_tried"]
        for r in runs
    )
    return 2 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
